"""Host side of what moves: the pinned arena of streamed blocks and the staging ring.

`HostArena` gives each streamed block one flat host buffer (same layout as a device slot).
Buffers are page-locked while the pinned budget lasts, so the copy engine reads them
asynchronously at full link speed; past the budget they stay pageable and reach the device
through the `StagingRing`: two pinned buffers that a worker thread fills ahead of use.

Page locking registers a page-aligned allocation of the block's size in place (torch's pinned
allocator rounds every allocation up to a power of two: 1 GiB for a 735 MiB block). Inside
ComfyUI it goes through ComfyUI's own `pin_memory` (`comfy_seam.memory.pin_host`), so the bytes are
booked in ComfyUI's pin budget (`TOTAL_PINNED_MEMORY` within `MAX_PINNED_MEMORY`) and refused
past it; outside ComfyUI through `cudaHostRegister` (CUDA and, under the same name, ROCm). A
refused registration falls back to a pageable, staged buffer, never to an error.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam.memory import pin_host, unpin_host
from .engine import CopyEngine

log = logging.getLogger(__name__)

def host_bytes(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(region, flat): `flat` holds `nbytes` at the start of `region`, which covers whole pages
    that no other allocation shares. Two registrations sharing a page would make the second
    one fail (the small heap allocations of a small block can share pages)."""
    page = mmap.PAGESIZE
    # a normal tensor even when allocated during ComfyUI's inference-mode execution: the
    # staging worker thread (outside inference mode) and later runs write into it in place
    with torch.inference_mode(False):
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    region = raw[start:start + -(-max(nbytes, 1) // page) * page]
    return region, region[:nbytes]


LIVE_BUFFERS: weakref.WeakSet[HostBuffer] = weakref.WeakSet()  # every host buffer not yet freed


def live_host_bytes() -> tuple[int, int]:
    """(bytes, pinned bytes) of the host buffers alive in this process (for memory checks)."""
    buffers = list(LIVE_BUFFERS)
    return (sum(b.flat.numel() for b in buffers),
            sum(b.flat.numel() for b in buffers if b.pinned))


@dataclass(eq=False)
class HostBuffer:
    """One block's host copy. `pinned`: page-locked now; `staged`: goes through the staging
    ring; `unpinned`: was page-locked, unlocked while its model is off the device."""

    region: torch.Tensor
    flat: torch.Tensor
    pinned: bool
    staged: bool
    unpinned: bool = False
    booked: bool = False  # pinned through ComfyUI (counted in its pin budget)

    def __post_init__(self) -> None:
        LIVE_BUFFERS.add(self)

    @classmethod
    def allocate(cls, nbytes: int, pin: bool, staged: bool) -> HostBuffer:
        region, flat = host_bytes(nbytes)
        pinned, booked = pin_host(region) if pin else (False, False)
        return cls(region, flat, pinned=pinned, staged=staged, booked=booked)

    def unpin(self) -> None:
        """Unlock the pages in place: bytes and views stay valid, only pageable now."""
        if self.pinned:
            unpin_host(self.region, self.booked)
            self.pinned, self.unpinned = False, True

    def repin(self) -> bool:
        """Lock again what `unpin` unlocked; False when refused (OS or ComfyUI's budget)."""
        if self.unpinned:
            self.pinned, self.booked = pin_host(self.region)
            self.unpinned = False
            return self.pinned
        return True

    def free(self) -> None:
        if self.pinned:
            unpin_host(self.region, self.booked)
            self.pinned = False
        self.unpinned = False
        LIVE_BUFFERS.discard(self)

    def __del__(self) -> None:
        # page-locked memory must be unregistered before its allocation is returned; this runs
        # while `region` is still referenced here, so the order holds even when `close` was
        # not called (a dropped patcher)
        try:
            self.free()
        except Exception:  # interpreter shutdown: the CUDA runtime may already be gone
            pass


def booked_bytes(buffers) -> int:
    """Bytes of `buffers` counted in ComfyUI's pin budget (whole pages: what was registered)."""
    return sum(b.region.numel() for b in buffers if b.pinned and b.booked)


class HostArena:
    """Flat host buffers for streamed blocks, pinned while `pinned_budget_bytes` lasts.

    `can_pin`: whether page locking is attempted (a CUDA/ROCm root); on a CPU root, blocks
    within the budget are copied directly and those past it still go through staging, so the
    bookkeeping is exercised the same way.
    """

    def __init__(self, pinned_budget_bytes: int | None, can_pin: bool):
        self.pinned_budget_bytes = pinned_budget_bytes
        self.can_pin = can_pin
        self.direct_bytes = 0  # within the budget (page-locked on a GPU root)
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self.refused_pins = 0

    def fits(self, nbytes: int) -> bool:
        budget = self.pinned_budget_bytes
        return budget is None or self.direct_bytes + nbytes <= budget

    def allocate(self, nbytes: int, want_direct: bool) -> HostBuffer:
        if want_direct and self.fits(nbytes) and not self.refused_pins:
            buffer = HostBuffer.allocate(nbytes, pin=self.can_pin, staged=False)
            if buffer.pinned or not self.can_pin:  # a CPU root copies straight from here
                self.direct_bytes += nbytes
                self.pinned_bytes += nbytes if buffer.pinned else 0
                return buffer
            # one refusal means the OS limit (or ComfyUI's pin budget) is reached: stop asking,
            # stage the rest
            self.refused_pins += 1
            log.warning("page locking %d bytes was refused (OS limit or ComfyUI's pin budget); "
                        "this block and the following ones stream through the staging ring "
                        "instead", nbytes)
            buffer.staged = True
        else:
            buffer = HostBuffer.allocate(nbytes, pin=False, staged=True)
        self.pageable_bytes += nbytes
        return buffer

    def forget(self, buffer: HostBuffer) -> None:
        nbytes = buffer.flat.numel()
        if buffer.staged:
            self.pageable_bytes -= nbytes
        else:
            self.direct_bytes -= nbytes
            self.pinned_bytes -= nbytes if buffer.pinned else 0
        buffer.free()

    def unpin(self, buffers: list[HostBuffer]) -> None:
        """Unlock `buffers` in place (their model left the device)."""
        for buffer in buffers:
            if buffer.pinned:
                buffer.unpin()
                self.pinned_bytes -= buffer.flat.numel()

    def repin(self, buffers: list[HostBuffer]) -> list[HostBuffer]:
        """Lock `buffers` again; returns those the OS refused (they must be staged now)."""
        refused = []
        for buffer in buffers:
            if not buffer.unpinned:
                continue
            if buffer.repin():
                self.pinned_bytes += buffer.flat.numel()
            else:
                # the copy engine cannot read pageable memory asynchronously: stage it
                buffer.staged = True
                self.direct_bytes -= buffer.flat.numel()
                self.pageable_bytes += buffer.flat.numel()
                self.refused_pins += 1
                refused.append(buffer)
        return refused


class StagingRing:
    """Pinned buffers that a worker thread fills from pageable block copies, ahead of use.

    Main thread: `schedule` (start filling), `take` (get a filled buffer), `release` (after the
    device copy from it was issued, with that copy's event). The worker waits on that event
    before overwriting the buffer. Only the main thread touches the bookkeeping.
    """

    def __init__(self, nbytes: int, engine: CopyEngine, buffers: int, can_pin: bool):
        self.engine = engine
        self.buffers = []
        for _ in range(buffers):
            self.buffers.append(HostBuffer.allocate(nbytes, pin=can_pin, staged=False))
        self._consumed: list[Any] = [None] * buffers
        self._free: deque[int] = deque(range(buffers))
        self._pending: dict[str, tuple[int, Future]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-staging")
        self.fills = 0

    @property
    def nbytes(self) -> int:
        return sum(b.flat.numel() for b in self.buffers)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.flat.numel() for b in self.buffers if b.pinned)

    @property
    def booked_bytes(self) -> int:
        return booked_bytes(self.buffers)

    def schedule(self, block_id: str, source_u8: torch.Tensor) -> bool:
        """Start filling a free buffer with `block_id`'s bytes; False when none is free."""
        if block_id in self._pending or not self._free:
            return False
        index = self._free.popleft()
        future = self._worker.submit(self._fill, index, self._consumed[index], source_u8)
        self._pending[block_id] = (index, future)
        return True

    def _fill(self, index: int, consumed: Any, source_u8: torch.Tensor) -> None:
        if consumed is not None:
            self.engine.host_wait(consumed)
        # a plain byte copy: inference mode lets it write a buffer made under either mode
        with torch.inference_mode():
            self.buffers[index].flat[:source_u8.numel()].copy_(source_u8)

    def take(self, block_id: str, source_u8: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A buffer holding `block_id`'s bytes (filled now if it was not scheduled)."""
        if block_id not in self._pending:
            if not self._free:
                self._drop_oldest()
            self.schedule(block_id, source_u8)
        index, future = self._pending.pop(block_id)
        # the device copy reads this buffer next: it must be completely filled. This host wait
        # only blocks when the worker fell behind (or the order of blocks changed)
        future.result()
        self.fills += 1
        return index, self.buffers[index].flat[:source_u8.numel()]

    def is_pending(self, block_id: str) -> bool:
        return block_id in self._pending

    def discard(self, block_id: str) -> None:
        """Forget a scheduled fill (the block's weights changed)."""
        if block_id in self._pending:
            index, future = self._pending.pop(block_id)
            future.result()  # the worker may still be writing the buffer
            self._free.append(index)

    def release(self, index: int, consumed_event: Any) -> None:
        self._consumed[index] = consumed_event
        self._free.append(index)

    def _drop_oldest(self) -> None:
        self.discard(next(iter(self._pending)))

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        for buffer in self.buffers:
            buffer.free()
        self.buffers = []
