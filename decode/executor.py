"""Decode the windows of one video latent on several devices into one output buffer.

Each device gets a contiguous range of windows [a, b) and runs the VAE's own `decode_temporal`
on the latent frames those windows read (cut at window starts, so the range needs no padding
except at the end of the clip, where the model pads as it always does), writing straight into
its part of the caller's output buffer: the output frames from window a's head up to window b's
head. Everything inside the range, windows, tiles, tile batches, cross-fades, finalisation and
writes, is the release's own code (`decode.release`).

Each range writes exactly what the model's loop writes for that latent on its own
(`decode_output_shape` of the range), starting at its first head. Across a cut the model's loop
over the whole clip would have cross-faded window a-1's tail into window a's head; instead range
k-1 wrote its last tail as is (as the end of its clip) and range k its first head as is (there
was no tail before it), both over the same first frames of range k. The split sees both raw
pieces (the first part and the last tail the model hands to `_finalize_pixels` in a range, on a
view of the model that wraps that method) and, once every range is done, writes the cut's head
again as the model's loop would have: `_finalize_pixels(blend(tail, head, frame_overlap,
dim=-3))`. The blend is elementwise, so any device gives the same bits. A release whose loop
does not hand those pieces over (`NotFollowed`) is decoded again on the root by its own loop.

The root's range runs on the calling thread, each helper's on a thread of its own (as ComfyUI's
multi-GPU thread pool runs the devices other than the main one); two ranges on one GPU (a
plumbing test on one card) take turns, as ComfyUI's per-device offload streams and cast buffers
are not made for two threads at once. Between its windows the calling thread counts finished
windows for the progress bar and checks ComfyUI's interrupt; when a helper fails it lets the
others finish, then decodes the helper's range on the root, with one warning. A helper whose
own layers saw ComfyUI's cancel first (ComfyUI clears the flag as it raises) hands the cancel
back: every range stops after its current window and the calling thread raises it.

Legend: B batch, C=3 channels, F frames, H x W pixels; z_BCTHW is the latent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from ..comfy_seam.devices import device_context
from ..comfy_seam.interrupts import is_interrupt
from ..exchange.streams import current_stream, new_stream, on_streams, record, wait
from .replica import make_replica
from .shares import DecodeReport, DeviceShare, NotFollowed
from .window_range import Stopped, WindowRange
from .windows import WindowLayout

log = logging.getLogger("h3_multigpu")


class SplitDecode:
    """One split decode: `SplitDecode(model, layout, shares, output=...).run(z)`."""

    def __init__(self, model: nn.Module, layout: WindowLayout, shares: list[DeviceShare], *,
                 output: torch.Tensor, progress: Callable[[int], None] | None = None,
                 check_interrupt: Callable[[], None] | None = None,
                 poll_seconds: float = 0.05) -> None:
        if not shares or shares[0].model is None:
            raise ValueError("the first share is the root's and needs the loaded model")
        self.model = model
        self.layout = layout
        self.shares = shares
        self.output = output
        self.progress = progress or (lambda n: None)
        self.check_interrupt = check_interrupt or (lambda: None)
        self.poll_seconds = poll_seconds
        self.stop = threading.Event()
        self.report = DecodeReport([str(s.device) for s in shares], [s.windows for s in shares])
        self._report_lock = threading.Lock()
        self._windows = 0
        self._pad = 0
        # ranges on one GPU take turns (ComfyUI's per-device offload streams, cast buffers)
        self._turns = {str(d): threading.Lock() for d in {s.device for s in shares}
                       if d.type == "cuda" and sum(s.device == d for s in shares) > 1}
        self._offsets: list[int] = []  # output frame of each share's first head
        self._lengths: list[int] = []  # frames each share's range writes (its own output)

    # --- where each range reads and writes ------------------------------------------------------

    def _plan_cuts(self, z_BCTHW: torch.Tensor) -> None:
        """Window count and padding from the model's own `_decode_temporal_chunks`, and the
        output frame where each window's head starts, from its own `decode_output_shape`:
        window a's head starts where the frames of the windows from a to the end do not
        reach. ValueError when a cut would not give the model's own ranges."""
        model, t = self.model, z_BCTHW.shape[2]
        self._pad, self._windows = model._decode_temporal_chunks(t)
        covered = [i for s in self.shares for i in range(*s.windows)]
        if covered != list(range(self._windows)):
            raise ValueError(f"the shares {[s.windows for s in self.shares]} do not cover the "
                             f"{self._windows} windows in order")
        shape = tuple(z_BCTHW.shape)
        total = model.decode_output_shape(shape)[2]
        if total != self.output.shape[2]:
            raise ValueError(f"the output has {self.output.shape[2]} frames, the VAE decodes "
                             f"{total} from this latent")
        self._offsets, self._lengths = [], []
        for share in self.shares:
            a, b = share.windows
            if a == b:
                self._offsets.append(self._offsets[-1] if self._offsets else 0)
                self._lengths.append(0)
                continue
            lo, hi = self._latent_range(share.windows, t)
            pad, count = model._decode_temporal_chunks(hi - lo)
            if count != b - a or pad != (self._pad if b == self._windows else 0):
                raise NotFollowed(f"latent frames {lo}-{hi - 1} decode as {count} window(s) "
                                  f"with {pad} padded, not as windows {a}-{b - 1}: this VAE's "
                                  f"windows do not cut at multiples of {self.layout.stride} "
                                  f"latent frames")
            suffix = model.decode_output_shape(shape[:2] + (t - lo,) + shape[3:])[2]
            self._offsets.append(total - suffix)
            self._lengths.append(model.decode_output_shape(shape[:2] + (hi - lo,) + shape[3:])[2])
        starts = [o for o, n in zip(self._offsets, self._lengths, strict=True) if n]
        if starts != sorted(starts) or starts[0] != 0:
            raise NotFollowed(f"the ranges' first heads would land at frames {starts}")

    def _latent_range(self, windows: tuple[int, int], t: int) -> tuple[int, int]:
        """Latent frames [lo, hi) the windows read (the last range: to the end of the clip)."""
        a, b = windows
        lo = a * self.layout.stride
        hi = t if b == self._windows else (b - 1) * self.layout.stride + \
            self.layout.window_latents
        return lo, hi

    def _output_part(self, k: int) -> torch.Tensor:
        """Share k's part of the output: what its range writes, from its first head on (its
        last tail overlaps the next range's first frames, written again at the cut)."""
        start = self._offsets[k]
        return self.output[:, :, start:min(start + self._lengths[k], self.output.shape[2])]

    # --- the devices ------------------------------------------------------------------------------

    def record_call(self, window: int | None, batch: int) -> None:
        if window is None:
            return
        with self._report_lock:
            calls = self.report.tile_batches.get(window, ())
            self.report.tile_batches[window] = (*calls, batch)

    def _helper_inputs(self, share: DeviceShare, z_BCTHW: torch.Tensor, ready
                       ) -> tuple[nn.Module, torch.Tensor]:
        """The helper's model (a copy of the root's unless ComfyUI loaded one) and latent range
        on its device."""
        root = self.shares[0].device
        if share.model is not None and share.device == root:
            return share.model, z_BCTHW  # a second model on the root's device (tests, 1 GPU)
        src_side, dst_side = new_stream(root), new_stream(share.device)
        # the copies run on side streams of both GPUs so they do not queue behind the root's
        # decoding; they must start after the root's weights and latent are complete ...
        wait(src_side, ready)
        # ... and after whatever the helper's own stream was still doing with memory we reuse
        wait(dst_side, record(current_stream(share.device)))
        started = time.perf_counter()

        def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
            out = torch.empty_like(t, device=device)
            with on_streams(dst_side, src_side):
                out.copy_(t.detach(), non_blocking=True)
            return out

        model = share.model if share.model is not None else \
            make_replica(self.model, share.device, move)
        z_local = move(z_BCTHW, share.device)
        # the helper's decoding (its current stream) must see the finished copies
        wait(current_stream(share.device), record(dst_side))
        if dst_side is not None:
            dst_side.synchronize()  # time the copy honestly; it is once per decode
        if share.model is None:
            with self._report_lock:
                self.report.copy_seconds[str(share.device)] = time.perf_counter() - started
        return model, z_local

    def _decode_range(self, k: int, model: nn.Module, device: torch.device,
                      z_BCTHW: torch.Tensor, on_window: Callable[[int], None]) -> WindowRange:
        """Share k's windows with `model` on `device`; z_BCTHW is the latent range there."""
        part = WindowRange(self, model, self.shares[k].windows, on_window)
        part.decode(z_BCTHW, self._output_part(k))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # every write of the range is done
        return part

    def _work(self, k: int, z_BCTHW: torch.Tensor, ready, grad: bool, inference: bool) -> None:
        """A helper's range, on its own thread (as ComfyUI's multi-GPU thread pool runs the
        devices other than the main one)."""
        share, events = self.shares[k], self._events
        try:
            turn = self._turns.get(str(share.device), contextlib.nullcontext())
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    device_context(share.device), turn:
                lo, hi = self._latent_range(share.windows, z_BCTHW.shape[2])
                model, z_range = self._helper_inputs(share, z_BCTHW[:, :, lo:hi], ready)
                part = self._decode_range(k, model, share.device, z_range,
                                          lambda i: events.put(("window", k, i)))
            events.put(("done", k, part))
        except Stopped:
            pass
        except BaseException as exc:
            # a helper's comfy op may be the one that sees (and clears) ComfyUI's cancel: it
            # goes back to the calling thread as the cancel, never as a helper failure
            events.put(("interrupt" if is_interrupt(exc) else "failed", k, exc))
        finally:
            events.put(("exit", k, None))

    # --- the calling thread: the root's range, progress, interrupt, failures ------------------

    def _count(self, window: int) -> None:
        if window not in self._counted:
            self._counted.add(window)
            self.progress(1)

    def _handle(self, kind: str, k: int, payload) -> int:
        """One event from a helper; 1 when that helper's thread is done."""
        if kind == "window":
            self._count(payload)
        elif kind == "done":
            self._parts[k] = payload
        elif kind == "interrupt":
            if self._interrupt is None:
                self._interrupt = payload
            self.stop.set()  # every range stops after its current window
        elif kind == "failed":
            self._failed.append(k)
            device, root = self.shares[k].device, self.shares[0].device
            self.report.failed[str(device)] = f"{type(payload).__name__}: {payload}"
            log.warning("H3 multi-GPU decode: %s failed (%s: %s); its windows are decoded on "
                        "the root %s", device, type(payload).__name__, payload, root)
        return int(kind == "exit")

    def _check_interrupt(self) -> None:
        """ComfyUI's interrupt: every range stops after its current window; raised here."""
        if self._interrupt is None:
            try:
                self.check_interrupt()
            except BaseException as exc:
                self._interrupt = exc
                self.stop.set()
                raise

    def _poll(self, timeout: float | None) -> int:
        """Handle the helpers' events (waiting up to `timeout` for the first; None: do not
        wait); return how many helper threads ended."""
        ended = 0
        while True:
            try:
                event = (self._events.get(timeout=timeout) if timeout is not None
                         else self._events.get_nowait())
            except queue.Empty:
                break
            ended += self._handle(*event)
            timeout = None
        with contextlib.suppress(BaseException):
            self._check_interrupt()
        return ended

    def _root_window(self, window: int) -> None:
        """After each of the root's windows: count it, take in the helpers' news, and raise
        ComfyUI's interrupt here (the root's loop stops after this window)."""
        self._count(window)
        self._alive -= self._poll(None)
        self._check_interrupt()
        if self._interrupt is not None:  # a helper saw the cancel first
            raise self._interrupt

    # --- the whole decode -------------------------------------------------------------------

    def run(self, z_BCTHW: torch.Tensor) -> DecodeReport:
        """Decode latent z (de-normalised, on the root) into `output`; return the report.

        The root's range runs on the calling thread (ComfyUI's, where VAE.decode loaded the
        model), each helper's on a thread of its own."""
        started = time.perf_counter()
        self._plan_cuts(z_BCTHW)
        root = self.shares[0]
        ready = record(current_stream(root.device))
        self._events, self._counted, self._parts, self._failed = queue.Queue(), set(), {}, []
        self._interrupt = None
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        threads = [threading.Thread(target=self._work, name=f"h3-decode-{k}-{s.device}",
                                    args=(k, z_BCTHW, ready, grad, inference), daemon=True)
                   for k, s in enumerate(self.shares) if k and s.count]
        for t in threads:
            t.start()
        self._alive = len(threads)
        root_error: BaseException | None = None
        if root.count:
            lo, hi = self._latent_range(root.windows, z_BCTHW.shape[2])
            turn = self._turns.get(str(root.device), contextlib.nullcontext())
            try:
                with device_context(root.device), turn:
                    self._parts[0] = self._decode_range(0, root.model, root.device,
                                                        z_BCTHW[:, :, lo:hi], self._root_window)
            except BaseException as exc:
                if exc is not self._interrupt and not isinstance(exc, Stopped):
                    root_error = exc
                self.stop.set()  # the helpers stop after their current window
        while self._alive:
            self._alive -= self._poll(self.poll_seconds)
        for t in threads:
            t.join()
        if self._interrupt is not None:
            raise self._interrupt
        if root_error is not None:
            raise root_error
        for k in self._failed:  # on the root, in this thread: the model's own loop again
            lo, hi = self._latent_range(self.shares[k].windows, z_BCTHW.shape[2])
            with device_context(root.device):
                self._parts[k] = self._decode_range(k, root.model, root.device,
                                                    z_BCTHW[:, :, lo:hi], self._count)
        self._blend_cuts(self._parts)
        self.report.seconds = time.perf_counter() - started
        return self.report

    def _blend_cuts(self, parts: dict[int, WindowRange]) -> None:
        """Each cut's head written again as the model's loop writes it: the previous range's
        tail cross-faded into it (`blend`, `_finalize_pixels`: the model's own, elementwise),
        on the root. NotFollowed (before any write) when a range that wrote past its cut did
        not hand over a tail, or the next range no raw first head."""
        model, device = self.shares[0].model, self.shares[0].device
        cls = type(model)
        used = sorted(parts)
        cuts = []
        for prev, k in zip(used[:-1], used[1:], strict=True):
            past = self._offsets[prev] + self._lengths[prev] - self._offsets[k]
            if past <= 0:
                continue  # the ranges do not overlap: a model without tails fades nothing
            tail, head = parts[prev].tail, parts[k].first_part
            if tail is None or head is None or tail.shape[2] != past:
                raise NotFollowed(f"the window loop wrote {past} frames past the cut at window "
                                  f"{self.shares[k].windows[0]} without handing its tail and "
                                  f"the next head to _finalize_pixels as the split expects")
            cuts.append((k, tail, head))
        for k, tail, head in cuts:
            mixed = cls.blend(model, tail.to(device), head.to(device), model.frame_overlap,
                              dim=-3)
            pixels = cls._finalize_pixels(model, mixed)
            start = self._offsets[k]
            n = min(pixels.shape[2], self.output.shape[2] - start)
            if n > 0:
                self.output[:, :, start:start + n].copy_(pixels[:, :, :n])
            self.report.handovers += 1
