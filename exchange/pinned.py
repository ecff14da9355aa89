"""Pinned host slots of the exchange (the Dual-Sage host relay, the sequence links' relay),
page-locked the way the prefetcher's host copies are: inside ComfyUI through its own
`pin_memory`, so they are booked in its pin budget (`TOTAL_PINNED_MEMORY` within
`MAX_PINNED_MEMORY`) and refused past it; outside ComfyUI with `cudaHostRegister`. A refused pin
leaves the slot pageable: the relay then copies synchronously, slower but the same bytes.

torch's own pinned allocator (`pin_memory=True`) would take the same memory unseen by ComfyUI's
budget, and it rounds each allocation up to a power of two. Memory registered here is not
tracked by that allocator's events either: the owner waits for the last copy that reads or
writes a slot (`drain`) before it frees it.
"""

from __future__ import annotations

import logging

import torch

from ..common.arena import HostBuffer

log = logging.getLogger(__name__)
_warned = False


def should_pin(*devices: torch.device) -> bool:
    """Page-lock relay slots serving these devices (a CUDA/ROCm one among them)."""
    return torch.cuda.is_available() and any(d.type == "cuda" for d in devices)


def host_slot(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, HostBuffer]:
    """A flat host tensor of `numel` elements and the buffer that owns (and unpins) it."""
    global _warned
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = HostBuffer.allocate(nbytes, pin=pin, staged=False)
    if pin and not buffer.pinned and not _warned:
        _warned = True
        log.warning("page locking a %.1f MiB relay slot was refused (ComfyUI's pin budget or "
                    "the OS limit): the host relay copies through pageable memory, slower",
                    nbytes / (1 << 20))
    return buffer.flat.view(dtype), buffer


def drain(events) -> None:
    """Wait on the host until every event (the last copies using some slots) completed, so
    the slots can be unpinned and freed; None and simulated events need nothing."""
    for event in events:
        if isinstance(event, torch.cuda.Event):
            event.synchronize()


def free(buffers: list[HostBuffer]) -> None:
    for buffer in buffers:
        buffer.free()
    buffers.clear()
