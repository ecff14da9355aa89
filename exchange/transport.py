"""Moving one head chunk to a helper and its output back: peer copies or a pinned host relay.

Both transports take contiguous chunks only: a contiguous source lets the copy engines move it
(a strided gather would need a copy kernel that waits for SMs the root's attention holds, which
measured 1.04x instead of 1.9x on two H200s). Each send returns the event marking the chunk's
arrival on the helper; each fetch records, in the workspace, the event after which the helper's
ring slot is free again.

Legend: g heads in a chunk, S sequence, D head dim.
"""

from __future__ import annotations

import enum

import torch

from .streams import Event, Lane, launch, record, wait
from .workspace import Workspace


class TransportMode(enum.Enum):
    AUTO = "auto"
    PEER = "peer"
    HOST = "host"

    @classmethod
    def parse(cls, value: TransportMode | str) -> TransportMode:
        """A mode, or its name as a user writes it; ValueError naming the value otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"transport {value!r} is unknown; use 'auto', 'peer' or "
                             "'host'") from None


def peer_access(root: torch.device, helper: torch.device) -> bool:
    """True when both GPUs can read each other's memory directly (NVLink or PCIe P2P)."""
    if root.type != "cuda" or helper.type != "cuda":
        return True  # CPU stand-ins: a plain copy
    return bool(torch.cuda.can_device_access_peer(root, helper)
                and torch.cuda.can_device_access_peer(helper, root))


def resolve(mode: TransportMode, root: torch.device, helper: torch.device) -> TransportMode:
    if mode is TransportMode.AUTO:
        return TransportMode.PEER if peer_access(root, helper) else TransportMode.HOST
    return mode


def _copy(dst: torch.Tensor, src: torch.Tensor):
    return lambda: dst.copy_(src, non_blocking=True)


def send_chunk(mode: TransportMode, lane: Lane, ws: Workspace, chunk: int,
               slot_3gSD: torch.Tensor, send_3gSD: torch.Tensor) -> Event:
    """Copy a root chunk into a helper ring slot; returns the arrival event on `helper_in`."""
    # the slot still holds the output of the chunk `ring_slots` earlier until it is fetched:
    # overwriting it sooner sends that chunk's q to the root instead of its output
    wait(lane.helper_in, ws.slot_free[chunk % ws.ring_slots])
    if mode is TransportMode.PEER:
        launch((lane.helper_in, lane.root_send), _copy(slot_3gSD, send_3gSD))
        return record(lane.helper_in)
    relay = chunk % len(ws.pinned_in)
    pinned = ws.pinned_in[relay][: send_3gSD.numel()].view_as(send_3gSD)
    # the host slot is read by the previous upload from it; overwriting earlier corrupts it
    wait(lane.root_send, ws.pinned_in_free[relay])
    launch((lane.root_send,), _copy(pinned, send_3gSD))
    downloaded = record(lane.root_send)
    # the upload must not start before the download into the host slot completed
    wait(lane.helper_in, downloaded)
    launch((lane.helper_in,), _copy(slot_3gSD, pinned))
    ws.pinned_in_free[relay] = record(lane.helper_in)
    return record(lane.helper_in)


def fetch_chunk(mode: TransportMode, lane: Lane, ws: Workspace, chunk: int,
                recv_gSD: torch.Tensor, out_gSD: torch.Tensor, computed: Event) -> None:
    """Copy a chunk's output from the helper slot into the root's receive buffer."""
    # the output exists only once the helper's attention for this chunk has finished
    wait(lane.helper_out, computed)
    if mode is TransportMode.PEER:
        launch((lane.root_recv, lane.helper_out), _copy(recv_gSD, out_gSD))
        ws.slot_free[chunk % ws.ring_slots] = record(lane.helper_out)
        return
    relay = chunk % len(ws.pinned_out)
    pinned = ws.pinned_out[relay][: out_gSD.numel()].view_as(out_gSD)
    # the host slot is still being uploaded to the root from the previous use of it
    wait(lane.helper_out, ws.pinned_out_free[relay])
    launch((lane.helper_out,), _copy(pinned, out_gSD))
    downloaded = record(lane.helper_out)
    ws.slot_free[chunk % ws.ring_slots] = downloaded
    # the root must not read the host slot before the helper's download landed in it
    wait(lane.root_recv, downloaded)
    launch((lane.root_recv,), _copy(recv_gSD, pinned))
    ws.pinned_out_free[relay] = record(lane.root_recv)
