"""Streams and events that become no-ops on the CPU, so the sharding logic runs in CPU tests.

A `Lane` is everything one helper needs on both GPUs: five streams (root side: send, receive;
helper side: in, compute, out). On CUDA/ROCm they are real side streams; when the "devices" are
all the CPU (tests), every stream is None, every event None and every copy synchronous.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Stream = torch.cuda.Stream | None
Event = torch.cuda.Event | None


def new_stream(device: torch.device) -> Stream:
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> Stream:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def record(stream: Stream) -> Event:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait(stream: Stream, event: Event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


@contextlib.contextmanager
def on_streams(*streams: Stream) -> Iterator[None]:
    """Make each stream current on its own device; the LAST one's device is current inside.

    PyTorch runs a cross-device `copy_` on the source device's current stream and makes the
    destination device's current stream wait for it (and vice versa before the copy), so a copy
    between two GPUs must name the current stream of both: `on_streams(dst_side, src_side)`.
    """
    with contextlib.ExitStack() as stack:
        for stream in streams:
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
        yield


@dataclass
class Lane:
    """The streams serving one helper (all None on the CPU)."""

    root: torch.device
    helper: torch.device
    root_send: Stream
    root_recv: Stream
    helper_in: Stream
    helper_compute: Stream
    helper_out: Stream

    @classmethod
    def create(cls, root: torch.device, helper: torch.device) -> Lane:
        return cls(root=root, helper=helper, root_send=new_stream(root),
                   root_recv=new_stream(root), helper_in=new_stream(helper),
                   helper_compute=new_stream(helper), helper_out=new_stream(helper))

    @property
    def root_streams(self) -> tuple[Stream, ...]:
        return (self.root_send, self.root_recv)

    @property
    def helper_streams(self) -> tuple[Stream, ...]:
        return (self.helper_in, self.helper_compute, self.helper_out)
