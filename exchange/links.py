"""A one-way link between two devices of one process: contiguous copies on copy streams.

`Link(src, dst)` owns a send stream on `src` and a receive stream on `dst`. `copy(dst, src,
after=...)` moves one contiguous tensor and returns the event (on the receive stream) after which
the destination holds it. Two transports, chosen per link:

- peer: one device-to-device copy. PyTorch runs a cross-device `copy_` on the SOURCE device's
  current stream and makes the two devices' current streams wait for each other around it, so
  the copy is issued with the send stream current on `src` and the receive stream current on
  `dst` (`on_streams(recv, send)`): it then waits for nothing but the events named here, never for
  a kernel queued on a compute stream (issued there, the prototype's copies queued behind the
  next phase's compute: 1.06x instead of 1.9x).
- host: a pinned host relay for GPUs without peer access: device -> pinned slot on the send
  stream, pinned slot -> device on the receive stream, through a ring of pinned slots so the
  download of one piece overlaps the upload of the previous one.

Only contiguous tensors travel, so the copy engines move them; a strided gather would need a copy
kernel competing for the SMs the attention holds. On CPU stand-in devices (tests) streams and
events are None and every copy is synchronous.
"""

from __future__ import annotations

import torch

from . import pinned
from .streams import Event, Stream, new_stream, on_streams, record, wait
from .transport import TransportMode, resolve

RELAY_SLOTS = 2


class Link:
    """Copies from `src` to `dst` (any two devices; equal CPU devices in tests)."""

    def __init__(self, src: torch.device, dst: torch.device,
                 mode: TransportMode = TransportMode.AUTO):
        self.src = src
        self.dst = dst
        self.mode = resolve(mode, src, dst)
        # streams belong to their device: create each with its device current
        self.send: Stream = _stream_on(src)
        self.recv: Stream = _stream_on(dst)
        self._pinned: list[torch.Tensor] = []
        self._host: list = []  # owners of the pinned slots (exchange.pinned)
        self._pinned_free: list[Event] = []
        self._next_slot = 0
        self.copies = 0
        self.bytes = 0

    @property
    def streams(self) -> tuple[Stream, Stream]:
        return self.send, self.recv

    def reserve(self, nbytes: int) -> None:
        """Size the host relay's pinned slots for pieces up to `nbytes` (setup, not per copy).

        Growing waits for the copies through the old slots, then frees them.
        """
        if self.mode is not TransportMode.HOST:
            return
        if self._pinned and self._pinned[0].numel() >= nbytes:
            return
        # registered memory no allocator tracks: the last copies through the old slots must
        # be done before they are unpinned; booked in ComfyUI's pin budget (exchange.pinned)
        pinned.drain(self._pinned_free)
        pinned.free(self._host)
        pin = pinned.should_pin(self.src, self.dst)
        self._pinned = []
        for _ in range(RELAY_SLOTS):
            flat, owner = pinned.host_slot(nbytes, torch.uint8, pin)
            self._pinned.append(flat)
            self._host.append(owner)
        self._pinned_free = [None] * RELAY_SLOTS
        self._next_slot = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Event = None,
             dst_ready: Event = None) -> Event:
        """`dst.copy_(src)` for contiguous tensors of equal size; returns the arrival event.

        after: event recorded where `src` was produced (on the source device); the copy starts
        once it completed. dst_ready: event on `dst`'s device after which `dst` may be written:
        recorded on the compute stream right after `dst` was allocated there, since the caching
        allocator may hand out memory whose previous tensor's kernels are still queued on that
        stream (stream-ordered reuse protects that stream only, not our copy streams).
        The returned event lives on the receive stream of `dst`'s device: a stream that reads
        `dst` must wait on it. Callers keep `src` and `dst` alive until the copy completed
        (`record_stream` on `self.send` / `self.recv`, or buffers owned for longer).
        """
        assert src.is_contiguous() and dst.is_contiguous() and src.numel() == dst.numel(), \
            "links move contiguous tensors of equal size only"
        self.copies += 1
        self.bytes += src.numel() * src.element_size()
        # the destination's memory may still be in use by queued kernels of its last owner
        # (peer: PyTorch makes the send stream wait for the receive stream before the copy)
        wait(self.recv, dst_ready)
        # the source is written by a stream of its own device: copying before that finished
        # would move stale or half-written rows
        wait(self.send, after)
        if self.mode is TransportMode.PEER:
            with on_streams(self.recv, self.send):
                dst.copy_(src, non_blocking=True)
            return record(self.recv)
        return self._relay(dst, src)

    def _relay(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        nbytes = src.numel() * src.element_size()
        if not self._pinned or self._pinned[0].numel() < nbytes:
            self.reserve(nbytes)  # unplanned size: grows once, then reused
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._pinned)
        host = self._pinned[slot][:nbytes].view(src.dtype).view(src.shape)
        # the slot is still being uploaded from by the piece that used it last: overwriting it
        # before that upload finished would corrupt that piece on its way
        wait(self.send, self._pinned_free[slot])
        with on_streams(self.send):
            host.copy_(src, non_blocking=True)
        downloaded = record(self.send)
        # the upload must not read the slot before the download into it completed
        wait(self.recv, downloaded)
        with on_streams(self.recv):
            dst.copy_(host, non_blocking=True)
        arrived = record(self.recv)
        self._pinned_free[slot] = arrived
        return arrived

    def close(self) -> None:
        """Drop the relay slots once every copy issued on this link completed (teardown only)."""
        for stream in (self.send, self.recv):
            if stream is not None:
                # pinned slots and the tensors callers handed in may be freed after this
                stream.synchronize()
        self._pinned, self._pinned_free = [], []
        pinned.free(self._host)


def _stream_on(device: torch.device) -> Stream:
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return new_stream(device)


def keep_until_used(tensor: torch.Tensor, *streams: Stream) -> None:
    """Tell the caching allocator that `tensor` is used by side `streams` too.

    It was allocated on a compute stream; without this, freeing it while a queued copy on a side
    stream still reads or writes it would let the allocator hand its memory to a new tensor.
    """
    if tensor.device.type != "cuda":
        return
    for stream in streams:
        if stream is not None and stream.device == tensor.device:
            tensor.record_stream(stream)
