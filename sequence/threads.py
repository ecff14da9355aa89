"""Per-share host threads for the sequence mode, and the abortable rendezvous between them.

Upstream's `DiTBlock.forward` cannot be suspended in the middle (the head exchange sits inside
its attention call), so every row share runs it on a host thread of its own: the root share on
the thread that runs the model's block loop, each helper share on a persistent `ShareWorker`.
torch keeps its modes per thread, so a dispatch carries the caller's state into the worker
(`TorchState`): grad and inference mode, autocast, the current stream of every device, the
CPU thread count, and the ContextVars (`contextvars.copy_context`, which threads do not
inherit). The current device is the share's own. `torch.backends` flags (sdpa_kernel) are
process-wide and need nothing.

`Exchange` is the one place shares wait for each other: `post(key, value)` and
`take(key)`. Whatever goes wrong in one share, an exception, an out-of-memory error, ComfyUI's
interrupt flag (seen by any share at its next post or take), or a wait longer than `timeout_s`,
aborts the exchange: every share blocked in `take` raises `ExchangeAborted` at once, and the
root re-raises the first error. A share busy in device code finishes what it queued and meets
the abort at its next take.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam import interrupts
from ..comfy_seam.devices import device_context

DEFAULT_TIMEOUT_S = 600.0  # a helper's host side may stall on a weight upload or a cudaMalloc
POLL_S = 0.05  # how often a blocked share looks at the abort and interrupt flags


class ExchangeAborted(Exception):
    """Raised in the shares that did not fail: another share's error stopped the block."""


class Exchange:
    """One block's rendezvous: values posted by one share and taken by others."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._values: dict[Any, Any] = {}
        self._cond = threading.Condition()
        self.error: BaseException | None = None  # the first failure, re-raised on the root

    def post(self, key: Any, value: Any) -> None:
        self._check()
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def take(self, key: Any) -> Any:
        """The value posted under `key`, waiting for it (abortable)."""
        self._check()
        deadline = None
        with self._cond:
            while key not in self._values:
                if self.error is not None:
                    raise ExchangeAborted(f"another share failed: {self.error!r}")
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now >= deadline:
                    error = TimeoutError(f"sequence parallel: no share posted {key!r} within "
                                         f"{self.timeout_s:g} s (a share is stuck)")
                    self._abort_locked(error)
                    raise error
                self._cond.wait(min(POLL_S, deadline - now))
                if interrupts.processing_interrupted():
                    break
            else:
                return self._values[key]
        self._check()  # the interrupt flag was seen: raises
        return self.take(key)

    def abort(self, error: BaseException) -> None:
        with self._cond:
            self._abort_locked(error)

    def _abort_locked(self, error: BaseException) -> None:
        if self.error is None and not isinstance(error, ExchangeAborted):
            self.error = error
        self._cond.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise ExchangeAborted(f"another share failed: {self.error!r}")
        try:
            interrupts.raise_if_interrupted()
        except BaseException as exc:  # ComfyUI's InterruptProcessingException is one
            self.abort(exc)
            raise


@dataclass
class TorchState:
    """The caller thread's torch state that a share's thread must run under."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    streams: tuple[Any, ...]
    threads: int
    context: contextvars.Context

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> TorchState:
        autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu")
                         if torch.is_autocast_enabled(kind))
        streams = tuple(torch.cuda.current_stream(d) for d in dict.fromkeys(devices)
                        if d.type == "cuda")
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                   streams, torch.get_num_threads(), contextvars.copy_context())

    @contextlib.contextmanager
    def entered(self, device: torch.device):
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            if not self.inference:
                stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            for stream in self.streams:
                # the caller's current stream on each device: the scatter's waits and the
                # caching allocator's stream-ordered reuse are on it
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(device_context(device))
            yield


class ShareWorker:
    """A persistent host thread that runs one helper share's work, one call at a time."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.busy = False
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], state: TorchState, device: torch.device,
               on_error: Callable[[BaseException], None]) -> None:
        """Run `fn` on this thread; `on_error` is called there the moment it raises (so the
        other shares are released before the root collects the results)."""
        assert not self.busy, "one call at a time per share"
        self.busy = True
        self._jobs.put((fn, state, device, on_error))

    def result(self, timeout_s: float) -> tuple[Any, BaseException | None]:
        """(value, error) of the submitted call; TimeoutError when it did not finish."""
        try:
            out = self._done.get(timeout=timeout_s)
        except queue.Empty:
            return None, TimeoutError(f"sequence parallel: the share on {self._thread.name} "
                                      f"did not finish within {timeout_s:g} s")
        self.busy = False
        return out

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, state, device, on_error = job
            try:
                with state.entered(device):
                    value = state.context.run(fn)
                self._done.put((value, None))
            except BaseException as exc:  # handed to the root, which re-raises the first
                on_error(exc)
                self._done.put((None, exc))
            self.calls += 1

    def close(self) -> None:
        self._jobs.put(None)
        if not self.busy:
            self._thread.join(timeout=5.0)


def run_shares(workers: Sequence[ShareWorker | None], jobs: Sequence[Callable[[], Any]],
               devices: Sequence[torch.device], exchange: Exchange) -> list[Any]:
    """Run jobs[0] on this thread and jobs[k] on workers[k]; the first error re-raised here.

    Every share is released when one fails (the exchange aborts); this returns or raises only
    after every worker handed its call back, so the next block starts with idle workers (a
    worker past the timeout is dropped: `workers[k]` is set busy and the caller replaces it).
    """
    state = TorchState.capture(devices)
    for k in range(1, len(jobs)):
        worker = workers[k]
        assert worker is not None
        # one Context can be entered by one thread at a time: a copy per share
        worker.submit(jobs[k], dataclasses.replace(state, context=contextvars.copy_context()),
                      devices[k], exchange.abort)
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    try:
        results[0] = jobs[0]()
    except BaseException as exc:
        exchange.abort(exc)
        errors.append(exc)
    for k in range(1, len(jobs)):
        worker = workers[k]
        assert worker is not None
        value, error = worker.result(exchange.timeout_s + 5.0)
        if error is not None:
            exchange.abort(error)
            errors.append(error)
        results[k] = value
    if not errors:
        return results
    first = exchange.error or errors[0]
    # every share has returned: nothing waits on the exchange any more. Its reference to the
    # error, and this frame's, would make a cycle through the traceback that keeps the
    # block's tensors alive until a garbage collection
    exchange.error = None
    del errors, results, jobs, exchange, state, worker, value, error
    try:
        raise first
    finally:
        del first
