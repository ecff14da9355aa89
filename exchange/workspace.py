"""Buffers of one helper lane, allocated once per (S, heads, D, dtype) and reused across calls.

Root side: `send` holds the helper's q|k|v chunk by chunk, each chunk one contiguous
`[3, g, S, D]` block, and `recv` the helper's output `[h, S, D]`. Helper side: a ring of
`ring_slots` chunk slots `[3, g, S, D]` (the chunk's output overwrites its q). Host relay only:
two pinned upload and two pinned download slots. Memory is bounded by the ring, not by the
helper's head count.

Legend: h helper heads, g heads per chunk, S sequence, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .streams import Event, Lane

HOST_RELAY_SLOTS = 2


@dataclass(frozen=True)
class WorkspaceKey:
    seq_len: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_heads: int
    ring_slots: int
    host_relay: bool


@dataclass
class Workspace:
    key: WorkspaceKey
    send: torch.Tensor  # root, flat: chunk-major [3, g, S, D] blocks
    recv: torch.Tensor  # root, [h, S, D]
    ring: list[torch.Tensor]  # helper, flat slots of 3*g*S*D
    pinned_in: list[torch.Tensor] = field(default_factory=list)
    pinned_out: list[torch.Tensor] = field(default_factory=list)
    slot_free: list[Event] = field(default_factory=list)
    pinned_in_free: list[Event] = field(default_factory=list)
    pinned_out_free: list[Event] = field(default_factory=list)

    @property
    def ring_slots(self) -> int:
        return len(self.ring)

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
    def allocate(cls, key: WorkspaceKey, lane: Lane) -> Workspace:
        per_chunk = 3 * key.chunk_heads * key.seq_len * key.head_dim
        slots = min(key.ring_slots, -(-key.heads // key.chunk_heads))
        ring = [torch.empty(per_chunk, dtype=key.dtype, device=lane.helper) for _ in range(slots)]
        send = torch.empty(3 * key.heads * key.seq_len * key.head_dim, dtype=key.dtype,
                           device=lane.root)
        recv = torch.empty(key.heads, key.seq_len, key.head_dim, dtype=key.dtype,
                           device=lane.root)
        ws = cls(key=key, send=send, recv=recv, ring=ring, slot_free=[None] * slots)
        if key.host_relay:
            pin = torch.cuda.is_available() and lane.root.type == "cuda"
            ws.pinned_in = [torch.empty(per_chunk, dtype=key.dtype, pin_memory=pin)
                            for _ in range(HOST_RELAY_SLOTS)]
            ws.pinned_out = [torch.empty(per_chunk // 3, dtype=key.dtype, pin_memory=pin)
                             for _ in range(HOST_RELAY_SLOTS)]
            ws.pinned_in_free = [None] * HOST_RELAY_SLOTS
            ws.pinned_out_free = [None] * HOST_RELAY_SLOTS
        return ws

    def release(self, lane: Lane) -> None:
        """Hand the buffers back to the allocator only after every side stream is done with them.

        They were allocated on the devices' current streams but are used on the lane's side
        streams; without record_stream the allocator could give them to a new tensor while a
        queued copy or attention of an earlier call still reads or writes them.
        """
        for tensor in (self.send, self.recv):
            for stream in lane.root_streams:
                if stream is not None:
                    tensor.record_stream(stream)
        for tensor in self.ring:
            for stream in lane.helper_streams:
                if stream is not None:
                    tensor.record_stream(stream)
        self.ring.clear()
