"""Decode the windows of one video latent on several devices into one output buffer.

One worker thread per device decodes a contiguous range of windows with the model's own window
code (`_adaptive_decode`: spatial tiles, tile batches, in the VAE dtype) on that device's copy
of the decoder. Each window's frames are finalised (float32, [0, 1]) on its device and written
straight into the caller's output buffer by a second thread per device, on a side stream, while
the device decodes its next window. Across a cut between two devices the 5 cross-faded frames
need the tail of one window and the head of the next: whichever device finishes the second of
the two pieces fetches the other piece (5 frames) and does the cross-fade, which is elementwise
and so gives the same bits on either device.

The main thread only orchestrates: it counts finished windows for the progress bar, polls the
interrupt check, and when a helper fails it lets the others finish, then decodes the helper's
range (and the two neighbouring windows' boundary pieces) on the root, with one warning.

Legend: B batch, C=3 channels, F frames, H x W pixels; z_BCTHW is the latent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..exchange.streams import current_stream, new_stream, on_streams, record, wait
from ..guard.device import device_context
from .replica import make_replica
from .windows import WindowLayout

log = logging.getLogger("h3_multigpu")


@dataclass
class DeviceShare:
    """One device's part: its windows [start, stop) and, for the root, the loaded model."""

    device: torch.device
    windows: tuple[int, int]
    model: nn.Module | None = None  # None: a copy of the root's model is made on `device`

    @property
    def count(self) -> int:
        return self.windows[1] - self.windows[0]


@dataclass
class DecodeReport:
    """What one split decode did (for the status line, the tests and the benchmark)."""

    devices: list[str]
    windows: list[tuple[int, int]]
    seconds: float = 0.0
    copy_seconds: dict[str, float] = field(default_factory=dict)  # decoder copy per helper
    failed: dict[str, str] = field(default_factory=dict)  # helper -> error, its windows redone
    handovers: int = 0  # boundary pieces fetched from another device
    tile_batches: dict[int, tuple[int, ...]] = field(default_factory=dict)  # window -> calls

    @property
    def same_tile_batches(self) -> bool:
        """Every window decoded with the same tile batches (the one-device decode's pattern)."""
        return len(set(self.tile_batches.values())) <= 1

    def describe(self) -> str:
        pairs = zip(self.devices, self.windows, strict=True)
        parts = [f"{d} windows {a}-{b - 1}" for d, (a, b) in pairs if b > a]
        text = f"decoded on {len(parts)} device(s): " + ", ".join(parts)
        if self.failed:
            text += "; " + "; ".join(f"{d} failed ({e}), its windows redone on the root"
                                     for d, e in self.failed.items())
        return text


class _HostWriter:
    """Writes finished frames into the output on a side stream of their device.

    `put` returns at once unless `depth` parts are already waiting, which bounds the device
    memory held by frames in flight to `depth` float32 heads.
    """

    def __init__(self, device: torch.device, output: torch.Tensor, depth: int) -> None:
        self.device = device
        self.output = output
        self.stream = new_stream(device)
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"h3-decode-write-{device}",
                                       daemon=True)
        self.thread.start()

    def put(self, frames_BCFHW: torch.Tensor, start: int) -> None:
        if self.error is not None:
            raise self.error
        # the side stream must not read the frames before the decode that made them finished
        ready = record(current_stream(self.device))
        self.queue.put((frames_BCFHW, start, ready))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            frames, start, ready = item
            if self.error is not None:
                continue  # drain: the worker sees the error at its next put or at close
            try:
                # a plain copy: ComfyUI decodes under inference mode, and its output (an
                # inference tensor) accepts in-place writes only inside inference mode, which
                # a new thread does not inherit
                with torch.inference_mode(), device_context(self.device), \
                        on_streams(self.stream):
                    wait(self.stream, ready)
                    self._write(frames, start)
                    if self.stream is not None:
                        # the allocator must not hand these frames to the decode stream again
                        # until this side stream has read them
                        frames.record_stream(self.stream)
            except BaseException as exc:  # reported to the worker, which fails its device
                self.error = exc
            del frames

    def _write(self, frames: torch.Tensor, start: int) -> None:
        stop = min(start + frames.shape[2], self.output.shape[2])
        if stop <= start:
            return  # frames past the output's end (padding): upstream drops them too
        n = stop - start
        # per (sample, channel) the target is one contiguous block: a direct copy, no staging
        for b in range(frames.shape[0]):
            for c in range(frames.shape[1]):
                self.output[b, c, start:stop].copy_(frames[b, c, :n])

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.stream is not None:
            # the output must be complete when the decode returns (device-to-device targets)
            self.stream.synchronize()
        if self.error is not None:
            raise self.error


@dataclass
class _Piece:
    frames_BCFHW: torch.Tensor  # raw decoder frames (VAE dtype) on the device that made them
    owner: int  # which lane made it


class _Pieces:
    """Boundary pieces (a window's 5-frame tail, the next window's first 5 head frames) until
    both sides of a boundary exist; then exactly one thread claims the boundary."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tails: dict[int, _Piece] = {}
        self.heads: dict[int, _Piece] = {}
        self.claimed: set[int] = set()

    def add(self, window: int, head: _Piece | None, tail: _Piece | None
            ) -> list[tuple[int, _Piece, _Piece]]:
        """Register a finished window's pieces; return the boundaries now ready (claimed)."""
        ready = []
        with self.lock:
            if head is not None:
                self.heads[window] = head
            if tail is not None:
                self.tails[window] = tail
            for b in (window, window + 1):
                if b in self.claimed or b - 1 not in self.tails or b not in self.heads:
                    continue
                self.claimed.add(b)
                ready.append((b, self.tails.pop(b - 1), self.heads.pop(b)))
        return ready


@dataclass
class _Lane:
    """What a thread needs to decode windows on one device."""

    device: torch.device
    model: nn.Module
    z_BCTHW: torch.Tensor  # latent frames [latent_start, ...) on this device
    latent_start: int
    writer: _HostWriter
    owner: int


class SplitDecode:
    """One split decode: `SplitDecode(model, layout, shares, output=...).run(z)`."""

    def __init__(self, model: nn.Module, layout: WindowLayout, shares: list[DeviceShare], *,
                 output: torch.Tensor, progress: Callable[[int], None] | None = None,
                 check_interrupt: Callable[[], None] | None = None, copy_depth: int = 1,
                 poll_seconds: float = 0.05) -> None:
        if not shares or shares[0].model is None:
            raise ValueError("the first share is the root's and needs the loaded model")
        self.model = model
        self.layout = layout
        self.shares = shares
        self.output = output
        self.progress = progress or (lambda n: None)
        self.check_interrupt = check_interrupt or (lambda: None)
        self.copy_depth = copy_depth
        self.poll_seconds = poll_seconds
        self.pieces = _Pieces()
        self.report = DecodeReport([str(s.device) for s in shares], [s.windows for s in shares])
        self._report_lock = threading.Lock()
        self._current = threading.local()
        self._windows = 0

    # --- one window -----------------------------------------------------------------------

    def _window(self, lane: _Lane, i: int, emit: bool = True
                ) -> tuple[_Piece | None, _Piece | None]:
        """Decode window i on `lane`; write its own frames; return its boundary pieces."""
        layout, model = self.layout, lane.model
        first = i * layout.stride - lane.latent_start
        clip = lane.z_BCTHW[:, :, first:first + layout.window_latents]
        self._current.window = i
        raw = model._adaptive_decode(clip)  # the model's own tiles and tile batches
        self._current.window = None
        split = layout.stride * layout.frames_per_latent  # decoded frames before the tail
        head = raw[:, :, layout.lead_drop:split]
        tail = raw[:, :, split + layout.lead_drop:] if layout.tail_frames else None
        blend = layout.blend_frames if tail is not None else 0
        last = i == self._windows - 1
        if emit:
            skip = blend if i > 0 else 0  # the first frames of a head wait for the cross-fade
            self._emit(lane, head[:, :, skip:], layout.head_start(i) + skip)
            if last and tail is not None:
                self._emit(lane, tail, layout.head_start(i + 1))
        # clones: a view would keep the whole decoded window alive
        head_piece = _Piece(head[:, :, :blend].clone(), lane.owner) if i > 0 and blend else None
        tail_piece = (_Piece(tail[:, :, tail.shape[2] - blend:].clone(), lane.owner)
                      if not last and blend else None)
        return head_piece, tail_piece

    def _emit(self, lane: _Lane, raw: torch.Tensor, start: int) -> None:
        if raw.shape[2] == 0:
            return
        lane.writer.put(lane.model._finalize_pixels(raw), start)

    def _crossfade(self, lane: _Lane, b: int, tail: _Piece, head: _Piece) -> None:
        """Boundary b: the last frames of window b-1 faded into the first frames of window b,
        with the model's own blend (elementwise, so exact on any device). A piece made by
        another lane is handed over (a peer copy of 5 frames)."""
        # the copy runs on the owner's current stream in this thread (its default stream, the
        # one that produced the piece), so it reads the piece only once it is finished
        t, h = (p.frames_BCFHW.to(lane.device) for p in (tail, head))
        mixed = lane.model.blend(t, h, self.layout.crossfade, dim=-3)
        self._emit(lane, mixed, self.layout.head_start(b))
        with self._report_lock:
            self.report.handovers += (tail.owner != lane.owner) + (head.owner != lane.owner)

    def _finish_window(self, lane: _Lane, i: int) -> None:
        head, tail = self._window(lane, i)
        for b, t, h in self.pieces.add(i, head, tail):
            self._crossfade(lane, b, t, h)

    # --- devices ----------------------------------------------------------------------------

    def _lane(self, share: DeviceShare, z_BCTHW: torch.Tensor, ready) -> _Lane:
        """Model and latent range on `share.device` (a helper copies both from the root)."""
        a, b = share.windows
        lo = a * self.layout.stride
        hi = (b - 1) * self.layout.stride + self.layout.window_latents
        if share.model is not None:  # the root: its model and latent are already there
            return _Lane(share.device, share.model, z_BCTHW[:, :, lo:hi], lo,
                         _HostWriter(share.device, self.output, self.copy_depth),
                         self.shares.index(share))
        root = self.shares[0].device
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

        model = make_replica(self.model, share.device, move)
        z_local = move(z_BCTHW[:, :, lo:hi], share.device)
        # the helper's decoding (its current stream) must see the finished copies
        wait(current_stream(share.device), record(dst_side))
        if dst_side is not None:
            dst_side.synchronize()  # time the copy honestly; it is once per decode
        with self._report_lock:
            self.report.copy_seconds[str(share.device)] = time.perf_counter() - started
        return _Lane(share.device, model, z_local, lo,
                     _HostWriter(share.device, self.output, self.copy_depth),
                     self.shares.index(share))

    def _work(self, share: DeviceShare, z_BCTHW: torch.Tensor, ready, grad: bool,
              inference: bool, events: queue.Queue, stop: threading.Event) -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    device_context(share.device):
                lane = self._lane(share, z_BCTHW, ready)
                try:
                    for i in range(*share.windows):
                        if stop.is_set():
                            break
                        self._finish_window(lane, i)
                        events.put(("window", share, i))
                finally:
                    lane.writer.close()
                if share.device.type == "cuda":
                    torch.cuda.synchronize(share.device)  # every write and piece is done
        except BaseException as exc:
            events.put(("failed", share, exc))
        finally:
            events.put(("exit", share, None))

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """Record the tile batch of every decoder call, per window: a forward pre-hook on the
        root's decoder for the length of the decode. The helpers' copies are made after it is
        registered and copy the decoder's hook dict, so they carry the same hook (no second
        one); removing it leaves the root's model as it was."""
        decoder = getattr(self.shares[0].model, "decoder", None)
        handle = decoder.register_forward_pre_hook(self._count_call) if decoder else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    def _count_call(self, module: nn.Module, args: tuple) -> None:
        window = getattr(self._current, "window", None)
        if window is None or not args:
            return
        with self._report_lock:
            calls = self.report.tile_batches.get(window, ())
            self.report.tile_batches[window] = (*calls, int(args[0].shape[0]))

    # --- the whole decode -------------------------------------------------------------------

    def run(self, z_BCTHW: torch.Tensor) -> DecodeReport:
        """Decode latent z (de-normalised, on the root) into `output`; return the report."""
        with self._recording():
            return self._run(z_BCTHW)

    def _run(self, z_BCTHW: torch.Tensor) -> DecodeReport:
        started = time.perf_counter()
        pad, self._windows = self.layout.windows(z_BCTHW.shape[2])
        if pad:  # like the model: repeat the last latent frame so every window is whole
            z_BCTHW = torch.cat([z_BCTHW, z_BCTHW[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        covered = [i for s in self.shares for i in range(*s.windows)]
        if covered != list(range(self._windows)):
            raise ValueError(f"the shares {[s.windows for s in self.shares]} do not cover the "
                             f"{self._windows} windows in order")
        root = self.shares[0]
        ready = record(current_stream(root.device))
        events: queue.Queue = queue.Queue()
        stop = threading.Event()
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        threads = [threading.Thread(target=self._work, name=f"h3-decode-{s.device}",
                                    args=(s, z_BCTHW, ready, grad, inference, events, stop),
                                    daemon=True)
                   for s in self.shares if s.count]
        for t in threads:
            t.start()
        done: dict[int, set[int]] = {id(s): set() for s in self.shares}
        failed: list[DeviceShare] = []
        root_error: BaseException | None = None
        interrupt: BaseException | None = None
        alive = len(threads)
        while alive:
            try:
                kind, share, payload = events.get(timeout=self.poll_seconds)
            except queue.Empty:
                kind = None
            if kind == "window":
                done[id(share)].add(payload)
                self.progress(1)
            elif kind == "failed":
                if share is root:
                    root_error = payload
                    stop.set()
                else:
                    failed.append(share)
                    self.report.failed[str(share.device)] = f"{type(payload).__name__}: {payload}"
                    log.warning("H3 multi-GPU decode: %s failed (%s: %s); its windows are "
                                "decoded on the root %s", share.device, type(payload).__name__,
                                payload, root.device)
            elif kind == "exit":
                alive -= 1
            if interrupt is None:
                try:
                    self.check_interrupt()
                except BaseException as exc:  # ComfyUI's interrupt: stop after this window
                    interrupt = exc
                    stop.set()
        for t in threads:
            t.join()
        if interrupt is not None:
            raise interrupt
        if root_error is not None:
            raise root_error
        for share in failed:
            self._redo_on_root(share, z_BCTHW, done[id(share)])
        self.report.seconds = time.perf_counter() - started
        return self.report

    def _redo_on_root(self, share: DeviceShare, z_BCTHW: torch.Tensor, finished: set[int]
                      ) -> None:
        """A helper failed: decode its range on the root, and the boundary pieces of the two
        neighbouring windows (their owners already consumed or still hold them)."""
        root = self.shares[0]
        a, b = share.windows
        pieces = _Pieces()
        with device_context(root.device):
            lane = _Lane(root.device, root.model, z_BCTHW, 0,
                         _HostWriter(root.device, self.output, self.copy_depth), 0)
            try:
                for i in range(max(a - 1, 0), min(b + 1, self._windows)):
                    mine = a <= i < b
                    head, tail = self._window(lane, i, emit=mine)
                    # only the boundaries a .. b touch this range; keep the pieces they need
                    head = head if a <= i <= b else None
                    tail = tail if a - 1 <= i < b else None
                    for bd, t, h in pieces.add(i, head, tail):
                        self._crossfade(lane, bd, t, h)
                    if mine and i not in finished:
                        self.progress(1)
            finally:
                lane.writer.close()
