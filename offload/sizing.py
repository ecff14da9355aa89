"""Torch-free sizing for block streaming: what the prefetcher costs in bytes and in time.

Pure Python (no torch import) so the planner can size a run before anything is loaded.
The same rules are used by the runtime (`common.block_weights.BlockLayout`, `slots.SlotRing`,
`arena.HostArena`, `arena.StagingRing`), and tests check that both agree.

Vocabulary: a block is *resident* when its weights stay on the root GPU, *streamed* when they
live in host memory and are copied into one of the device *slots* just ahead of use. With
look-ahead K, the copy of the K-th next streamed block runs while the current one computes, so
the ring holds K + 1 slots (the running block plus K arriving ones).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..common.alignment import ALIGNMENT, aligned

# a block's flat buffer exceeds its tensors' bytes by < ALIGNMENT per tensor (leaf); this covers
# 256 leaves, several times what an H3 block has (quantized scales included)
ARENA_SLACK_PER_BLOCK = 64 * 1024
STAGING_BUFFERS = 2  # double-buffered: one is filled on the worker while the other is copied


def block_flat_bytes(tensor_nbytes: Iterable[int], alignment: int = ALIGNMENT) -> int:
    """Bytes of one block's flat buffer: every tensor (incl. quantized scales) aligned."""
    return sum(aligned(n, alignment) for n in tensor_nbytes)


def slot_count(lookahead: int, streamed_blocks: int) -> int:
    """Device slots for look-ahead K: K + 1, never more than there are streamed blocks."""
    if streamed_blocks <= 0:
        return 0
    return min(lookahead + 1, streamed_blocks)


def slot_ring_bytes(largest_block_bytes: int, lookahead: int, streamed_blocks: int) -> int:
    """Device bytes of the slot ring: each slot holds the largest streamed block."""
    return slot_count(lookahead, streamed_blocks) * largest_block_bytes


def pinned_arena_bytes(streamed_block_bytes: Iterable[int], budget_bytes: int | None) -> int:
    """Pinned host bytes: streamed blocks in execution order, each while it fits the budget.

    Blocks past the budget stay pageable and go through the staging ring instead.
    """
    total = 0
    for nbytes in streamed_block_bytes:
        if budget_bytes is not None and total + nbytes > budget_bytes:
            break
        total += nbytes
    return total


@dataclass(frozen=True)
class ArenaSplit:
    """Which streamed blocks' host copies are direct (pinned on a GPU root) and which stream
    through the staging ring, for blocks in host-copy order."""

    direct: tuple[bool, ...]
    direct_bytes: int
    staging_bytes: int  # pinned staging ring (0 when no block is staged)

    @property
    def staged_blocks(self) -> int:
        return sum(1 for d in self.direct if not d)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes on a GPU root: direct copies plus the staging ring."""
        return self.direct_bytes + self.staging_bytes


def arena_split(block_bytes: Sequence[int], budget_bytes: int | None, *, source: str = "auto",
                staging_buffers: int = STAGING_BUFFERS) -> ArenaSplit:
    """The runtime's rule (the streamer calls this; the planner too, so both agree).

    "pinned": every block direct, whatever the budget. "pageable": every block staged.
    "auto": when all blocks fit the budget, all are direct; otherwise the staging ring's
    buffers are paid from the budget first and blocks are direct while the rest lasts.
    """
    sizes = list(block_bytes)
    if source not in ("auto", "pinned", "pageable"):
        raise ValueError(f"source={source!r}: use 'auto', 'pinned' or 'pageable'")
    if source == "pageable":
        direct = [False] * len(sizes)
    elif source == "pinned" or budget_bytes is None or sum(sizes) <= budget_bytes:
        direct = [True] * len(sizes)
    else:
        left = max(0, budget_bytes - staging_ring_bytes(max(sizes), staging_buffers))
        direct = []
        for nbytes in sizes:
            fits = nbytes <= left
            left -= nbytes if fits else 0
            direct.append(fits)
    staged = [n for n, d in zip(sizes, direct, strict=True) if not d]
    return ArenaSplit(tuple(direct), sum(n for n, d in zip(sizes, direct, strict=True) if d),
                      staging_ring_bytes(max(staged), staging_buffers) if staged else 0)


def staging_ring_bytes(largest_pageable_block_bytes: int,
                       buffers: int = STAGING_BUFFERS) -> int:
    """Pinned bytes of the staging ring (zero when no block is pageable)."""
    return buffers * largest_pageable_block_bytes if largest_pageable_block_bytes > 0 else 0


def copy_seconds(block_bytes: int, link_gb_per_s: float) -> float:
    """Predicted host-to-device copy time of one block over a link of `link_gb_per_s` (1e9 B/s)."""
    if link_gb_per_s <= 0:
        raise ValueError(f"link_gb_per_s must be positive, got {link_gb_per_s}")
    return block_bytes / (link_gb_per_s * 1e9)


def step_overhead_seconds(*, blocks: int, streamed: int, block_compute_s: float,
                          block_copy_s: float, unhidden_copies: int = 0) -> float:
    """Predicted extra time per step from streaming `streamed` of `blocks` blocks.

    With resident blocks spread among the streamed ones, the copy engine has
    `blocks / streamed` blocks of compute to deliver each streamed block; any copy time above
    that shows up on the step. `unhidden_copies` counts copies with no compute to hide behind
    (e.g. the token refiner's blocks, which run on text only). The look-ahead does not change
    this throughput bound; it absorbs jitter between blocks.
    """
    if streamed <= 0:
        return 0.0
    slack_s = block_compute_s * blocks / streamed
    return streamed * max(0.0, block_copy_s - slack_s) + unhidden_copies * block_copy_s


def one_ahead_overhead_seconds(*, streamed: int, block_compute_s: float,
                               block_copy_s: float) -> float:
    """Predicted extra time per step when ComfyUI's DynamicVRAM streams `streamed` blocks.

    Its block prefetch (`comfy.model_prefetch.make_prefetch_queue`) stages the next block
    while one runs, whether that one is resident or not: each streamed block's copy has one
    block of compute to hide behind (the pack's streamer, with resident blocks spread and K
    ahead, has `blocks / streamed`).
    """
    return streamed * max(0.0, block_copy_s - block_compute_s)


def streamed_weight_vram_bytes(*, blocks: int, resident: int, block_bytes: int,
                               lookahead: int, extra_streamed: int = 0) -> int:
    """DiT block weights on the device: resident blocks plus the slot ring.

    `extra_streamed`: blocks outside the `blocks` (the token refiner's) that stream with them
    when any of them streams, and stay resident when none does.
    """
    streamed = blocks - resident
    if streamed == 0:
        return (blocks + extra_streamed) * block_bytes
    return resident * block_bytes + slot_ring_bytes(block_bytes, lookahead,
                                                    streamed + extra_streamed)


def resident_blocks_for_budget(vram_budget_bytes: int, *, blocks: int, block_bytes: int,
                               lookahead: int, extra_streamed: int = 0) -> int:
    """Most blocks that can stay resident when block weights may use `vram_budget_bytes`.

    All blocks when they fit outright (no slots needed); otherwise the count that leaves room
    for the K + 1 slots; 0 when even the slots alone do not fit (the caller reports that).
    `extra_streamed` as in `streamed_weight_vram_bytes`.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    best = 0
    for resident in range(blocks + 1):
        need = streamed_weight_vram_bytes(blocks=blocks, resident=resident,
                                          block_bytes=block_bytes, lookahead=lookahead,
                                          extra_streamed=extra_streamed)
        if need <= vram_budget_bytes:
            best = resident
    return best
