"""Copy engines: where a block's copy runs and how compute and copies order themselves.

`CudaCopyEngine` (CUDA and ROCm; torch.cuda is HIP there) issues copies on a dedicated copy
stream of the root device and orders them with events only: the compute stream waits on a
copy's event (`wait_event`, no host synchronisation) and a copy into a reused slot waits on the
event recorded after the previous occupant's compute. `SyncCopyEngine` runs the same calls
synchronously (CPU runs, CI), so the streamer's code path is the same on both.

Every engine method is one of: record an event after the compute issued so far, copy after
some events and return the copy's event, make compute wait for an event, make the calling host
thread wait (staging worker only), or synchronise everything (teardown only).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class CopyEngine(Protocol):
    device: torch.device

    def record_compute(self) -> Any: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> Any: ...

    def compute_wait(self, event: Any) -> None: ...

    def host_wait(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...


class SyncEvent:
    """Event of a synchronous engine: the work it marks was done when it was created."""

    __slots__ = ()


class SyncCopyEngine:
    """Copies run immediately on the calling thread; events are trivially complete."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def record_compute(self) -> SyncEvent:
        return SyncEvent()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> SyncEvent:
        dst.copy_(src)
        return SyncEvent()

    def compute_wait(self, event: Any) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaCopyEngine:
    """Copies on a side stream of the root device, ordered by events.

    `side_stream=False` issues copies on the compute stream instead: the plain "copy the next
    block before running it" baseline the benchmark compares against; not for users.
    """

    def __init__(self, device: torch.device, side_stream: bool = True):
        self.device = root_device(device)
        # streams belong to the device current at creation: make the root current so a root
        # on cuda:1 does not get a copy stream on cuda:0
        with torch.cuda.device(self.device):
            self.copy_stream = torch.cuda.Stream(device=self.device) if side_stream else None

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record_compute(self) -> torch.cuda.Event:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record(self._compute_stream())
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             after: list[torch.cuda.Event]) -> torch.cuda.Event:
        with torch.cuda.device(self.device):
            stream = self.copy_stream if self.copy_stream is not None else self._compute_stream()
            with torch.cuda.stream(stream):
                for event in after:
                    # the slot still holds the previous block until its compute finished:
                    # without this wait the copy overwrites weights a kernel is reading
                    stream.wait_event(event)
                dst.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
        return ready

    def compute_wait(self, event: torch.cuda.Event) -> None:
        # the block's kernels read the slot: without this wait they may run before its bytes
        # arrived. A stream wait, so the host keeps issuing work
        self._compute_stream().wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        # staging worker only: it must not overwrite a staging buffer the copy engine is still
        # reading; blocking the worker thread never stalls the compute thread
        event.synchronize()

    def synchronize(self) -> None:
        # teardown only: slots and host buffers are freed after this, and a copy still in
        # flight would read or write freed memory
        torch.cuda.synchronize(self.device)


def root_device(device: torch.device | str) -> torch.device:
    """`device` with an explicit index ("cuda" -> "cuda:N", the current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_engine(device: torch.device, side_stream: bool = True) -> CopyEngine:
    device = root_device(device)
    if device.type == "cuda":
        return CudaCopyEngine(device, side_stream=side_stream)
    return SyncCopyEngine(device)
