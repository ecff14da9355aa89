"""Chunk sizes for one H3 DiT block: the least chunking whose predicted peak fits (pure Python).

The block's memory model is `block_memory` (the moments of the block, chunked or not), its row
and head ranges `rows`, their exactness `exactness`; this module chooses chunks with them and
is what the planner and the sequence split import (`from ..chunking import sizing`), so it
names the model's public pieces too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import floors as common_floors
from ..common.block_memory import (  # noqa: F401
    LSE_BYTES,
    MLP_KERNELS,
    Adapters,
    BlockDims,
    BlockPeak,
    Kernels,
    attention_phase_peak_bytes,
    block_peak_bytes,
    check_sizes,
    linear_call_bytes,
    mlp_phase_peak_bytes,
    unchunked_block_peak_bytes,
)

# sequence/split.py still imports these two from here; their home is common.floors, which the
# code here reads at call time (a test scales the floors there)
from ..common.floors import EXACT_MIN_ROWS, MIN_QUERY_TILES_PER_CALL  # noqa: F401
from ..common.row_exactness import (  # noqa: F401
    RowFloors,
    exactness_note,
    floors_or_planned,
    head_reasons,
    note_of,
    planned_floors,
    row_reasons,
)
from ..common.rows import (  # noqa: F401
    ROW_ALIGN,
    head_groups,
    largest_chunk_rows,
    largest_head_group,
    query_tiles,
    row_chunks,
)

HEAD_GROUP_CANDIDATES = (28, 16, 8, 4)


@dataclass(frozen=True)
class ChunkChoice:
    """Chunk sizes for one block forward (0 = off) and what they are predicted to need."""

    ffn_chunk: int
    qkv_chunk: int
    head_group: int
    peak: BlockPeak
    budget_bytes: int
    fits: bool


def _row_candidates(tokens: int, granule: int, max_chunks: int = 64) -> list[int]:
    """Chunk sizes for 1..max_chunks chunks, largest first; granule-rounded while that large."""
    out: list[int] = []
    for n in range(1, min(tokens, max_chunks) + 1):
        rows = -(-tokens // n)
        if n > 1 and rows >= granule:
            rows = -(-rows // granule) * granule
        if n > 1 and rows >= tokens:
            continue
        if not out or rows < out[-1]:
            out.append(rows)
    return out


def choose_chunks(free_bytes: int, tokens: int, dims: BlockDims = BlockDims(), *,
                  adapters: Adapters = Adapters(), kernels: Kernels = Kernels(),
                  ffn_chunk: int | None = None, qkv_chunk: int | None = None,
                  head_group: int | None = None, headroom_fraction: float = 0.1,
                  headroom_bytes: int = 512 << 20, granule: int = 1024,
                  floors: RowFloors | None = None) -> ChunkChoice:
    """The least chunking whose block peak fits the memory free at block entry.

    free_bytes: bytes the allocator can still hand out when the block starts (x, the residual
    stream, is already allocated, so it is not counted against it). The budget keeps
    `headroom_fraction` of it and `headroom_bytes` back for fragmentation, cuBLAS workspaces and
    weight casts. A value given for ffn_chunk / qkv_chunk / head_group is kept; None chooses it.
    Preference, because each step costs a little more launches than the one before: no chunking;
    FFN rows (largest fitting chunk); QKV rows; then fewer heads per attention call. Only exact
    settings are chosen: row chunks of at least EXACT_MIN_ROWS, realised at or above each
    phase's floor (`floors`, None: `planned_floors`), head groups of at least EXACT_MIN_HEADS
    that keep MIN_QUERY_TILES_PER_CALL. A phase without a known floor is chunked only when
    nothing else fits (no chunking comes first anyway). `fits` is False when even the smallest
    of those exceed the budget (the most aggressive are returned).
    """
    check_sizes(tokens)
    if not isinstance(free_bytes, int) or free_bytes < 0:
        raise ValueError(f"free_bytes must be a non-negative int, got {free_bytes!r}")
    budget = int(free_bytes * (1.0 - headroom_fraction)) - headroom_bytes
    resident = tokens * dims.hidden * dims.element_bytes  # x, already allocated
    floors = floors_or_planned(floors, dims, adapters)

    def peak(ffn: int, qkv: int, group: int) -> BlockPeak:
        return block_peak_bytes(tokens, dims, ffn_chunk=ffn, qkv_chunk=qkv, head_group=group,
                                adapters=adapters, kernels=kernels, floors=floors)

    def fits(value: int) -> bool:
        return value - resident <= budget

    rows = _row_candidates(tokens, granule)
    # never below a phase's floor: a sequence too short for two chunks of it is not row-chunked
    # by "auto" at all
    ffn_options = [ffn_chunk] if ffn_chunk is not None else \
        [0] + [r for r in rows[1:] if r >= floors.split_floor("ffn") and not floors.never("ffn")]
    qkv_options = [qkv_chunk] if qkv_chunk is not None else \
        [0] + [r for r in rows[1:] if r >= floors.split_floor("qkv") and not floors.never("qkv")]
    tiles = query_tiles(tokens)
    group_options = ([head_group] if head_group is not None else
                     [0] + [g for g in HEAD_GROUP_CANDIDATES
                            if common_floors.EXACT_MIN_HEADS <= g < dims.heads
                            and g * tiles >= common_floors.MIN_QUERY_TILES_PER_CALL])
    # the phases are independent: FFN rows only move the MLP peak, QKV rows and head groups only
    # the attention peak (the chunked block's M0 moment is the same for any chunk setting)
    chunked = any((ffn_chunk, qkv_chunk, head_group))

    def mlp(ffn: int) -> int:
        return mlp_phase_peak_bytes(tokens, dims, ffn_chunk=ffn, adapters=adapters,
                                    kernels=kernels, chunked_block=chunked or ffn > 0,
                                    floors=floors)

    ffn = next((v for v in ffn_options if fits(mlp(v))), ffn_options[-1])
    attn = next(((q, g) for g in group_options for q in qkv_options
                 if fits(attention_phase_peak_bytes(tokens, dims, qkv_chunk=q, head_group=g,
                                                    adapters=adapters, kernels=kernels,
                                                    floors=floors))),
                None)
    if attn is None:
        attn = (qkv_options[-1], group_options[-1])
    result = peak(ffn, *attn)
    return ChunkChoice(ffn, attn[0], attn[1], result, budget, fits(result.peak_bytes))


def phase_fits_unchunked(free_bytes: int, tokens: int, dims: BlockDims, phase: str, *,
                         head_group: int, adapters: Adapters, kernels: Kernels,
                         headroom_bytes: int, headroom_fraction: float = 0.1) -> bool:
    """Whether `phase` ("ffn" or "qkv") fits unchunked in the budget `choose_chunks` would use
    (the chunked block forward runs, so the attention phase's h is freed before the MLP)."""
    budget = int(free_bytes * (1.0 - headroom_fraction)) - headroom_bytes
    resident = tokens * dims.hidden * dims.element_bytes
    if phase == "ffn":
        peak = mlp_phase_peak_bytes(tokens, dims, adapters=adapters, kernels=kernels,
                                    chunked_block=True)
    else:
        peak = attention_phase_peak_bytes(tokens, dims, head_group=head_group,
                                          adapters=adapters, kernels=kernels)
    return peak - resident <= budget
