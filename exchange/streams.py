"""Streams and events across the GPUs of one process, with a CPU stand-in and a CPU simulator.

Every piece of device work is issued through `launch(streams, fn)`: `fn` runs its torch ops with
`streams` current (the last one's device current inside). Ordering between streams is only what
`wait(stream, record(other))` states. Three modes, chosen per device:

- CUDA/ROCm: real side streams and events; `fn` runs now and its kernels queue on the streams.
- CPU stand-ins (tests): every stream and event is None and `fn` runs at once, synchronously.
- CPU simulator (`simulate()`, tests only): each stream is a queue whose work runs LAZILY, only
  when something waits on one of its events (then just up to that event) or when the host takes
  a result back (`host_continues`), where the simulator may first drain any chosen streams in
  full (`first=`). Work whose ordering rests on a missing `wait` then runs in the wrong order and
  reads stale or poisoned (NaN) buffers, so deleting any wait makes a test fail.

A `Lane` is everything one helper needs on both GPUs: five streams (root side: send, receive;
helper side: in, compute, out).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


class SimEvent:
    """A point in a simulated stream: complete once the stream ran `position` items."""

    def __init__(self, stream: SimStream, position: int):
        self.stream = stream
        self.position = position


class SimStream:
    """A lazily run queue of work and of waits on other simulated streams."""

    def __init__(self, sim: Simulator, role: str):
        self.sim = sim
        self.role = role
        self.items: list[tuple[str, object]] = []
        self.done = 0
        self._running = False

    def __repr__(self) -> str:
        return f"SimStream({self.role}, {self.done}/{len(self.items)})"

    def run_until(self, position: int) -> None:
        if self.done >= position:
            return
        if self._running:
            raise RuntimeError(f"simulated streams wait on each other in a cycle at {self!r}")
        self._running = True
        try:
            while self.done < position:
                kind, payload = self.items[self.done]
                if kind == "wait":
                    payload.stream.run_until(payload.position)
                else:
                    payload()
                self.done += 1
        finally:
            self._running = False


class Simulator:
    """The simulated streams of one test; `first` names the roles drained before the host's."""

    def __init__(self, first: Sequence[str] = ()):
        self.first = tuple(first)
        self.streams: list[SimStream] = []
        self.current = self._new("current")

    def _new(self, role: str) -> SimStream:
        stream = SimStream(self, role)
        self.streams.append(stream)
        return stream

    def host_continues(self) -> None:
        """The host reads what the current stream produced: run the chosen streams, then it."""
        for role in self.first:
            for stream in [s for s in self.streams if s.role == role]:
                stream.run_until(len(stream.items))
        self.current.run_until(len(self.current.items))

    def synchronize(self) -> None:
        """Everything queued runs (a device synchronize)."""
        for stream in self.streams:
            stream.run_until(len(stream.items))


_simulator: Simulator | None = None

Stream = torch.cuda.Stream | SimStream | None
Event = torch.cuda.Event | SimEvent | None


@contextlib.contextmanager
def simulate(first: Sequence[str] = ()) -> Iterator[Simulator]:
    """Tests only: CPU streams become lazily run queues (see the module docstring).

    `first`: stream roles ("current", "root_send", "root_recv", "helper_in", "helper_compute",
    "helper_out") drained in full, in that order, before the host takes a result back.
    """
    global _simulator
    previous, _simulator = _simulator, Simulator(first)
    try:
        yield _simulator
    finally:
        _simulator.synchronize()
        _simulator = previous


def simulating() -> bool:
    return _simulator is not None


def new_stream(device: torch.device, role: str = "side") -> Stream:
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return _simulator._new(role) if _simulator is not None else None


def current_stream(device: torch.device) -> Stream:
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return _simulator.current if _simulator is not None else None


def record(stream: Stream) -> Event:
    if stream is None:
        return None
    if isinstance(stream, SimStream):
        return SimEvent(stream, len(stream.items))
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait(stream: Stream, event: Event) -> None:
    """Work queued on `stream` from now on starts only after `event`."""
    if stream is None or event is None:
        return
    if isinstance(stream, SimStream):
        stream.items.append(("wait", event))
        return
    stream.wait_event(event)


def launch(streams: Sequence[Stream], fn: Callable[[], object]) -> None:
    """Issue `fn`'s device work on `streams` (the last one runs it; see `on_streams`).

    With several streams, as for a cross-device `copy_`, PyTorch orders the work after what is
    queued on every one of them and every one of them after the work; the simulator does the same.
    """
    sims = [s for s in streams if isinstance(s, SimStream)]
    if not sims:
        with on_streams(*streams):
            fn()
        return
    runner = sims[-1]
    for other in sims[:-1]:
        wait(runner, record(other))
    runner.items.append(("run", fn))
    for other in sims[:-1]:
        wait(other, record(runner))


def host_continues(stream: Stream) -> None:
    """The caller goes on with what was queued on `stream`, its device's current stream.

    On a GPU nothing is needed: the caller's next kernels queue behind it on the same stream.
    The simulator runs the queued work now (after the streams its `first` names).
    """
    if isinstance(stream, SimStream):
        stream.sim.host_continues()


def fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A newly allocated buffer; the simulator poisons it with NaN so reading it early shows."""
    if _simulator is not None and tensor.is_floating_point():
        tensor.fill_(math.nan)
    return tensor


@contextlib.contextmanager
def on_streams(*streams: Stream) -> Iterator[None]:
    """Make each stream current on its own device; the LAST one's device is current inside.

    PyTorch runs a cross-device `copy_` on the source device's current stream and makes the
    destination device's current stream wait for it (and vice versa before the copy), so a copy
    between two GPUs must name the current stream of both: `on_streams(dst_side, src_side)`.
    Simulated streams are ignored here: simulated work must go through `launch`.
    """
    with contextlib.ExitStack() as stack:
        for stream in streams:
            if isinstance(stream, torch.cuda.Stream):
                stack.enter_context(torch.cuda.stream(stream))
        yield


@dataclass
class Lane:
    """The streams serving one helper (all None on CPU stand-ins)."""

    root: torch.device
    helper: torch.device
    root_send: Stream
    root_recv: Stream
    helper_in: Stream
    helper_compute: Stream
    helper_out: Stream

    @classmethod
    def create(cls, root: torch.device, helper: torch.device) -> Lane:
        return cls(root=root, helper=helper, root_send=new_stream(root, "root_send"),
                   root_recv=new_stream(root, "root_recv"),
                   helper_in=new_stream(helper, "helper_in"),
                   helper_compute=new_stream(helper, "helper_compute"),
                   helper_out=new_stream(helper, "helper_out"))

    @property
    def root_streams(self) -> tuple[Stream, ...]:
        return (self.root_send, self.root_recv)

    @property
    def helper_streams(self) -> tuple[Stream, ...]:
        return (self.helper_in, self.helper_compute, self.helper_out)
