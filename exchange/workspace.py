"""Buffers of one helper lane, sized for the largest call seen and reused by every smaller one.

Root side: `send` holds the helper's q|k|v chunk by chunk, each chunk one contiguous
`[3, g, S, D]` block, and `recv` the helper's output `[h, S, D]`. Helper side: a ring of
chunk slots `[3, g, S, D]` (the chunk's output overwrites its q). Host relay only: two pinned
upload and two pinned download slots (booked in ComfyUI's pin budget: `pinned`). Memory is
bounded by the ring, not by the helper's head count.

Each call views the buffers with its own `WorkspaceKey`: a call that fits the capacity (the
fewer heads of the last head group of activation chunking, a shorter sequence) reuses them, so
uneven head groups (16, 16, 16, 8) do not reallocate twice per block; a larger call grows them.

Legend: h helper heads, g heads per chunk, S sequence, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import pinned
from .streams import Event, Lane, fresh

HOST_RELAY_SLOTS = 2


@dataclass(frozen=True)
class WorkspaceKey:
    """The shape of one call's share on one helper."""

    seq_len: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_heads: int
    ring_slots: int
    host_relay: bool

    @property
    def chunk_elems(self) -> int:
        return 3 * self.chunk_heads * self.seq_len * self.head_dim

    @property
    def slots(self) -> int:
        return min(self.ring_slots, -(-self.heads // self.chunk_heads))

    @property
    def send_elems(self) -> int:
        return 3 * self.heads * self.seq_len * self.head_dim


@dataclass
class Workspace:
    key: WorkspaceKey  # the call the buffers are viewed for now
    send: torch.Tensor  # root, flat: chunk-major [3, g, S, D] blocks
    recv_flat: torch.Tensor  # root, flat: [h, S, D]
    ring: list[torch.Tensor]  # helper, flat slots of 3*g*S*D
    pinned_in: list[torch.Tensor] = field(default_factory=list)
    pinned_out: list[torch.Tensor] = field(default_factory=list)
    slot_free: list[Event] = field(default_factory=list)
    pinned_in_free: list[Event] = field(default_factory=list)
    pinned_out_free: list[Event] = field(default_factory=list)
    host_buffers: list = field(default_factory=list)  # owners of the pinned slots

    @property
    def ring_slots(self) -> int:
        return len(self.ring)

    @property
    def recv(self) -> torch.Tensor:
        k = self.key
        return self.recv_flat[: k.heads * k.seq_len * k.head_dim].view(
            k.heads, k.seq_len, k.head_dim)

    def fits(self, key: WorkspaceKey) -> bool:
        """True when a call of shape `key` can use these buffers as they are."""
        return (key.dtype == self.key.dtype and key.host_relay == self.key.host_relay
                and self.send.numel() >= key.send_elems
                and self.recv_flat.numel() >= key.send_elems // 3
                and len(self.ring) >= key.slots and self.ring[0].numel() >= key.chunk_elems)

    def use(self, key: WorkspaceKey) -> Workspace:
        assert self.fits(key), (key, self.key)
        self.key = key
        return self

    def chunks(self) -> list[tuple[int, int]]:
        """[start, stop) of each chunk, in helper-local head indices."""
        k = self.key
        return [(a, min(a + k.chunk_heads, k.heads)) for a in range(0, k.heads, k.chunk_heads)]

    def send_chunk(self, start: int, stop: int) -> torch.Tensor:
        k = self.key
        per_head = k.seq_len * k.head_dim
        return self.send[3 * start * per_head: 3 * stop * per_head].view(
            3, stop - start, k.seq_len, k.head_dim)

    def slot(self, chunk: int, heads: int) -> torch.Tensor:
        k = self.key
        return self.ring[chunk % self.ring_slots][: 3 * heads * k.seq_len * k.head_dim].view(
            3, heads, k.seq_len, k.head_dim)

    @classmethod
    def allocate(cls, key: WorkspaceKey, lane: Lane, *, grow: Workspace | None = None
                 ) -> Workspace:
        """Buffers for `key`, at least as large as `grow`'s (which the caller then releases)."""
        # normal tensors even when the first call runs under ComfyUI's inference mode: the
        # workspace is cached and written in place by later calls under either mode
        with torch.inference_mode(False):
            return cls._allocate(key, lane, grow)

    @classmethod
    def _allocate(cls, key: WorkspaceKey, lane: Lane, grow: Workspace | None) -> Workspace:
        send_elems, chunk_elems, slots = key.send_elems, key.chunk_elems, key.slots
        if grow is not None and grow.key.dtype == key.dtype:
            send_elems = max(send_elems, grow.send.numel())
            chunk_elems = max(chunk_elems, grow.ring[0].numel() if grow.ring else 0)
            slots = max(slots, len(grow.ring))
        ring = [fresh(torch.empty(chunk_elems, dtype=key.dtype, device=lane.helper))
                for _ in range(slots)]
        send = fresh(torch.empty(send_elems, dtype=key.dtype, device=lane.root))
        recv = fresh(torch.empty(send_elems // 3, dtype=key.dtype, device=lane.root))
        ws = cls(key=key, send=send, recv_flat=recv, ring=ring, slot_free=[None] * slots)
        if key.host_relay:
            # booked in ComfyUI's pin budget (exchange.pinned), unlike torch's pin_memory=True
            pin = pinned.should_pin(lane.root, lane.helper)
            for size, slots in ((chunk_elems, ws.pinned_in), (chunk_elems // 3, ws.pinned_out)):
                for _ in range(HOST_RELAY_SLOTS):
                    flat, owner = pinned.host_slot(size, key.dtype, pin)
                    slots.append(fresh(flat))
                    ws.host_buffers.append(owner)
            ws.pinned_in_free = [None] * HOST_RELAY_SLOTS
            ws.pinned_out_free = [None] * HOST_RELAY_SLOTS
        return ws

    def nbytes(self) -> int:
        tensors = [self.send, self.recv_flat, *self.ring, *self.pinned_in, *self.pinned_out]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self, lane: Lane) -> None:
        """Hand the buffers back to the allocator only after every side stream is done with them.

        They were allocated on the devices' current streams but are used on the lane's side
        streams; without record_stream the allocator could give them to a new tensor while a
        queued copy or attention of an earlier call still reads or writes them. The pinned host
        slots are registered memory no allocator tracks: the host waits for the last copy
        through each of them, then unpins and frees them (ComfyUI's budget gets them back).
        """
        for tensor in (self.send, self.recv_flat):
            for stream in lane.root_streams:
                if isinstance(stream, torch.cuda.Stream):
                    tensor.record_stream(stream)
        for tensor in self.ring:
            for stream in lane.helper_streams:
                if isinstance(stream, torch.cuda.Stream):
                    tensor.record_stream(stream)
        self.ring.clear()
        pinned.drain([*self.pinned_in_free, *self.pinned_out_free])
        self.pinned_in.clear()
        self.pinned_out.clear()
        pinned.free(self.host_buffers)
