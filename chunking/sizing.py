"""Activation memory of one H3 DiT block, chunked or not: pure Python, no torch.

The planner calls these before any weight moves; the chunked block forward (`block.py`) uses the
same `row_chunks` so the sizes it runs are the sizes predicted here. Every formula lists the
tensors alive at one moment of the code, in the order the code allocates them; a phase's peak is
the largest of its moments. Bytes include the residual stream x (the block's input, alive
throughout) and exclude the block's weights and the per-forward inputs shared by all blocks
(rotation table, time embedding).

Legend: S tokens (rows of the packed sequence), C hidden, H heads, D head dim, I = H*D inner,
F ffn width (fc1 writes 2F: gate | up), r LoRA rank, e bytes per element, m rows per chunk,
g heads per attention call.

Moments of the unchunked block (twin and upstream, identical structure):
  attention  A0 norm1(x):            x, h (+ the norm's temporaries when it is not fused)
             A1 qkv_proj(h):         x, h, qkv [S,3I] (+ adapter output [S,3I] and down [S,r])
             A2 SDPA:                x, h, qkv, out [S,I] (+ logsumexp [H,S] fp32, or the
                                     reshape copy of out [S,I] when the backend's layout needs one)
             A3 out_proj:            x, h, out [S,I], proj [S,C] (+ adapter temporaries)
  mlp        M0 norm2(x):            x, the attention phase's h, the new h (+ norm temporaries)
             M1 fc1(h):              x, h, fc1 [S,2F] (+ adapter output [S,2F] and down [S,r])
             M2 swiglu:              x, h, fc1, silu(gate) [S,F] and, in the twin, the product [S,F]
             M3 fc2:                 twin: x, h, product, proj [S,C]
                                     ComfyUI: x, h, fc1 (still held by linear_input_act), product,
                                     proj [S,C]; INT8 fuses the product into an int8 [S,F] buffer
Chunked: the projection rows go m at a time into one preallocated [S,3I] buffer and h is freed
once it is consumed; attention over g heads per call writes into one [S,I] buffer; out_proj, fc1,
swiglu, fc2 and the LoRA adapters see m rows at a time, each chunk gated into x in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..common import geometry

MLP_KERNELS = ("twin", "comfy", "comfy_int8")
ROW_ALIGN = 128  # chunk rows are rounded to GEMM tile multiples so every chunk is a full-tile GEMM
LSE_BYTES = 4  # SDPA's logsumexp is fp32 [H, S]
HEAD_GROUP_CANDIDATES = (28, 16, 8, 4)
# Exactness floors. A chunked GEMM equals the unchunked one bit for bit only while cuBLAS keeps the
# same kernel (same K-reduction order): on an H200, bf16 chunks of ~3,400 rows and more did, chunks
# of ~800-2,300 rows did not (max |diff| 0.016-0.031 in bf16 through the model). A requested chunk
# at or above EXACT_MIN_ROWS is therefore never realised below it (`row_chunks`); smaller explicit
# chunks are honoured and reported as "may differ at bf16 rounding". On-activation adapters add
# GEMMs of a few output columns whose kernel moves with the row count up to 8,192 rows (or never
# settles): `exact_rows` holds the measured floors per GPU and shape, and `RowFloors` carries a
# block's floors per phase. `dev/bench/sweep_chunk_exactness.py` measures them on the GPU at hand.
EXACT_MIN_ROWS = 4096
MIN_AUTO_CHUNK_ROWS = EXACT_MIN_ROWS  # "auto" and the planner never chunk rows below the floor
# A call with few heads x few query tiles makes flash attention split the keys across blocks
# (split-KV), which changes the summation order: head groups are exact only while every call
# keeps enough (head, 64-row query tile) work items; 1024 covers twice the SMs of any GPU here.
# A requested group of at least EXACT_MIN_HEADS heads is realised with fewer, larger groups where
# the sequence is too short for that (`head_groups`).
EXACT_MIN_HEADS = 4
MIN_QUERY_TILES_PER_CALL = 1024
QUERY_TILE_ROWS = 64
GiB = 1 << 30


def row_chunks(total: int, chunk: int, floor: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) row ranges covering `total` rows, each at most `chunk` rows.

    Balanced: n = ceil(total / chunk) chunks of nearly equal size (multiples of ROW_ALIGN where
    that leaves the tail at least half a chunk), so no tiny tail chunk falls back to a small-M
    GEMM kernel. `chunk <= 0` or `chunk >= total` gives one range. floor: the rows per call from
    which the phase's GEMMs are known exact (`RowFloors.split_floor`; None: EXACT_MIN_ROWS). A
    chunk of at least min(floor, EXACT_MIN_ROWS) is never realised below the floor: where
    balancing would go under it, fewer (and so larger than `chunk`) chunks are used, one range
    at the least. Smaller explicit chunks are honoured as given.
    """
    if total <= 0:
        return []
    if chunk <= 0 or chunk >= total:
        return [(0, total)]
    floor = EXACT_MIN_ROWS if floor is None else floor
    floor = floor if chunk >= min(floor, EXACT_MIN_ROWS) else 0
    n = -(-total // chunk)
    if floor and total // n < floor:
        n = max(1, total // floor)
        if n == 1:
            return [(0, total)]
    limit = max(chunk, -(-total // n))
    even = -(-total // n)
    aligned = -(-even // ROW_ALIGN) * ROW_ALIGN
    tail = total - aligned * (n - 1)
    if aligned <= limit and tail >= max(aligned // 2, floor, 1):
        return [(start, min(start + aligned, total)) for start in range(0, total, aligned)]
    base, extra = divmod(total, n)  # the first `extra` chunks take one row more
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def largest_chunk_rows(total: int, chunk: int, floor: int | None = None) -> int:
    """Rows of the largest range `row_chunks(total, chunk, floor)` produces (the peak's)."""
    return max((b - a for a, b in row_chunks(total, chunk, floor)), default=0)


def query_tiles(tokens: int) -> int:
    """(64-row) query tiles per head of one attention call over `tokens` rows."""
    return -(-tokens // QUERY_TILE_ROWS)


def head_groups(heads: int, group: int, tokens: int) -> list[tuple[int, int]]:
    """[h0, h1) head ranges of the attention calls for `group` heads per call (0 = one call).

    Balanced: ceil(heads / group) calls whose sizes differ by one head at most, so no tail
    call of one or two heads splits its keys (split-KV) where the others do not. A group of at
    least EXACT_MIN_HEADS is never realised with fewer heads than that, nor with fewer than
    MIN_QUERY_TILES_PER_CALL (head, query tile) work items per call: on short sequences fewer,
    larger groups (or one call) are used. Smaller explicit groups are honoured as given.
    """
    if heads <= 0:
        return []
    if group <= 0 or group >= heads:
        return [(0, heads)]
    n = -(-heads // group)
    if group >= EXACT_MIN_HEADS:
        per_call = max(EXACT_MIN_HEADS, -(-MIN_QUERY_TILES_PER_CALL // max(query_tiles(tokens), 1)))
        n = min(n, heads // per_call)
        if n <= 1:
            return [(0, heads)]
    base, extra = divmod(heads, n)
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def largest_head_group(heads: int, group: int, tokens: int) -> int:
    """Heads of the largest call `head_groups(heads, group, tokens)` makes (0 = one call)."""
    ranges = head_groups(heads, group, tokens)
    return 0 if len(ranges) <= 1 else max(b - a for a, b in ranges)


@dataclass(frozen=True)
class RowFloors:
    """Per chunked phase, rows per GEMM call from which row chunks are known bit-identical.

    qkv: qkv_proj and out_proj (the QKV row chunk runs both); ffn: fc1 and fc2, adapters
    included (`exact_rows` derives them from the measured table). 0: only EXACT_MIN_ROWS
    applies; an int: that many rows too; None: no floor is known (`qkv_why` / `ffn_why` say
    which GEMM), so chunks of that phase are never claimed exact (they are still split no finer
    than EXACT_MIN_ROWS, so no tiny tail makes it worse).
    """

    qkv: int | None = 0
    ffn: int | None = 0
    qkv_why: str = ""
    ffn_why: str = ""
    # set on a GPU model and dtype `exact_rows.json` does not list: its base floors are the
    # EXACT_MIN_ROWS rule carried over from the measured GPUs, an assumption the status says
    assumed: str = ""
    # per phase, the weight format's own minimum (`exact_rows.PhaseRule.base`): None the
    # EXACT_MIN_ROWS rule (plain weights), 1 any row count (INT8 ConvRot)
    qkv_base: int | None = None
    ffn_base: int | None = None
    # row slices change the result (NVFP4 without input_scale): the phase is never chunked
    qkv_never: bool = False
    ffn_never: bool = False

    @classmethod
    def of_rules(cls, qkv: Any, ffn: Any, assumed: str = "") -> RowFloors:
        """From the two phases' `exact_rows.PhaseRule`s."""
        return cls(qkv.floor, ffn.floor, qkv.why, ffn.why, assumed=assumed, qkv_base=qkv.base,
                   ffn_base=ffn.base, qkv_never=qkv.never, ffn_never=ffn.never)

    def known(self, phase: str) -> bool:
        return getattr(self, phase) is not None

    def never(self, phase: str) -> bool:
        return bool(getattr(self, f"{phase}_never"))

    def base(self, phase: str) -> int:
        value = getattr(self, f"{phase}_base")
        return EXACT_MIN_ROWS if value is None else value

    def split_floor(self, phase: str) -> int:
        """The floor `row_chunks` keeps this phase's chunks at (see there)."""
        return max(self.base(phase), getattr(self, phase) or 0)

    def exact_from(self, phase: str) -> int:
        """The smallest requested chunk `row_chunks` realises exactly (at or above the floor)."""
        return min(self.split_floor(phase), EXACT_MIN_ROWS)

    def why(self, phase: str) -> str:
        return getattr(self, f"{phase}_why") or f"{phase} has no known row floor"


def planned_floors(dims: BlockDims, adapters: Adapters,
                   weight_format: str = "bfloat16") -> RowFloors:
    """Floors the planner predicts with: the measured GPUs' table for these widths and adapters
    (one rank on every adapted linear), before the GPU's own kernels are known. weight_format:
    the DiT's block linears' (`exact_rows.FORMAT_RULES`: "int8_convrot" needs no row floor)."""
    return _planned_floors(dims, adapters, weight_format)


@lru_cache(maxsize=256)
def _planned_floors(dims: BlockDims, adapters: Adapters, weight_format: str) -> RowFloors:
    from ..common import exact_rows

    counts = {"qkv_proj": adapters.qkv, "out_proj": adapters.out_proj, "fc1": adapters.fc1,
              "fc2": adapters.fc2}
    ranks = {name: (adapters.rank,) if n > 0 else () for name, n in counts.items()}
    shapes = exact_rows.linear_shapes(dims.hidden, dims.inner, dims.ffn)
    table = exact_rows.planning_table()
    formats = dict.fromkeys(counts, weight_format)
    found = {phase: exact_rows.phase_rule(table, shapes, ranks, linears,
                                          where="the measured GPUs", formats=formats)
             for phase, linears in exact_rows.PHASE_LINEARS.items()}
    return RowFloors.of_rules(found["qkv"], found["ffn"])


def _floors(floors: RowFloors | None, dims: BlockDims, adapters: Adapters) -> RowFloors:
    return planned_floors(dims, adapters) if floors is None else floors


def row_reasons(phase: str, value: int | str, floors: RowFloors, *,
                tokens: int | None = None) -> list[str]:
    """Why chunks of `value` rows in `phase` may differ from the unchunked call ([] when
    exact). With `tokens`, only a value that really splits the sequence counts."""
    if not value or floors.never(phase):  # a never-split phase runs whole (the plan says so)
        return []
    if isinstance(value, int) and tokens is not None and \
            len(row_chunks(tokens, value, floors.split_floor(phase))) <= 1:
        return []
    if not floors.known(phase):
        if value == "auto":
            return [f"{floors.why(phase)}, if memory needs the {phase} chunked"]
        return [floors.why(phase)]
    if isinstance(value, int) and value < floors.exact_from(phase):
        return [f"{phase} chunks of {value} rows (< {floors.split_floor(phase)})"]
    return []


def head_reasons(head_group: int | str, *, heads: int | None = None,
                 tokens: int | None = None) -> list[str]:
    if not isinstance(head_group, int) or not 0 < head_group < EXACT_MIN_HEADS:
        return []
    if heads is not None and tokens is not None and \
            len(head_groups(heads, head_group, tokens)) <= 1:
        return []
    return [f"{head_group} heads per attention call (< {EXACT_MIN_HEADS})"]


def note_of(reasons: list[str] | tuple[str, ...]) -> str:
    """'exact', or the status note naming what may make chunked results differ."""
    if not reasons:
        return "exact"
    return f"may differ from unchunked at bf16 rounding ({'; '.join(dict.fromkeys(reasons))})"


def exactness_note(ffn_chunk: int | str, qkv_chunk: int | str, head_group: int | str,
                   floors: RowFloors | None = None) -> str:
    """'exact', or what may make chunked results differ from unchunked ones at bf16 rounding.

    Rows: chunks of at least EXACT_MIN_ROWS (or "auto", which never goes below) are realised at
    or above the phase's floor (`RowFloors`; default: EXACT_MIN_ROWS only), which keeps cuBLAS
    on the unchunked call's kernels; a phase without a known floor (an on-activation adapter
    nobody measured on this GPU) is not claimed exact. Heads: groups of at least
    EXACT_MIN_HEADS keep flash attention free of split-KV (`head_groups` enlarges them on short
    sequences). `dev/bench/sweep_chunk_exactness.py` measures the floors on other GPUs.
    """
    floors = RowFloors() if floors is None else floors
    reasons = [*row_reasons("ffn", ffn_chunk, floors), *row_reasons("qkv", qkv_chunk, floors),
               *head_reasons(head_group)]
    return note_of(reasons)


@dataclass(frozen=True)
class BlockDims:
    """Widths of one DiT block; defaults are the upstream H3 shapes in bf16."""

    hidden: int = geometry.HIDDEN
    heads: int = geometry.HEADS
    head_dim: int = geometry.HEAD_DIM
    ffn: int = geometry.FFN
    element_bytes: int = 2

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Adapters:
    """On-activation adapters (LoRA/bypass) per linear: counts of stacked adapters, and rank."""

    rank: int = 0
    qkv: int = 0
    fc1: int = 0
    out_proj: int = 0
    fc2: int = 0

    @classmethod
    def turbo_lora(cls, rank: int) -> Adapters:
        """What the planner assumes: one on-activation LoRA of `rank` on qkv_proj and fc1
        (the turbo LoRA's targets); none for rank 0."""
        return cls(rank=rank, qkv=1, fc1=1) if rank else cls()


@dataclass(frozen=True)
class Kernels:
    """What the kernels allocate beyond their outputs.

    mlp: "twin" (silu temporary, fc1 freed before fc2), "comfy" (`linear_input_act` eager
    SwiGLU: silu then in-place multiply, fc1 held during fc2), "comfy_int8" (SwiGLU fused into
    the INT8 activation quantizer: an int8 [S,F] buffer). attention_output_copy: the attention
    backend's [1,H,S,D] output needs a copy to become [1,S,H*D] (False for SDPA flash/efficient).
    norm_temp_bytes: bytes of temporaries per element of [S,C] while RMSNorm runs, beyond its
    output (0 for a fused kernel; a composite bf16 RMSNorm upcasts to fp32 on the way).
    """

    mlp: str = "twin"
    attention_output_copy: bool = False
    norm_temp_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.mlp not in MLP_KERNELS:
            raise ValueError(f"mlp kernel {self.mlp!r} is unknown; use one of {MLP_KERNELS}")


def linear_call_bytes(rows: int, out_features: int, adapters: int, rank: int, e: int) -> int:
    """Peak bytes of one linear call on `rows` rows including its output.

    With bypass adapters the adapter's up-projection output exists next to the base output
    (plus the [rows, r] down output) until one is added into the other; stacked adapters repeat
    this one at a time, so the peak does not grow with their count.
    """
    out = rows * out_features * e
    if adapters <= 0:
        return out
    return 2 * out + rows * rank * e


def _attention_call_bytes(rows: int, heads: int, dims: BlockDims, kernels: Kernels) -> int:
    out = rows * heads * dims.head_dim * dims.element_bytes
    during_kernel = out + heads * rows * LSE_BYTES
    return max(during_kernel, 2 * out) if kernels.attention_output_copy else during_kernel


def _check(tokens: int, **chunks: int) -> None:
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    for name, value in chunks.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0 = off), got {value!r}")


def attention_phase_peak_bytes(tokens: int, dims: BlockDims = BlockDims(), *,
                               qkv_chunk: int = 0, head_group: int = 0,
                               adapters: Adapters = Adapters(),
                               kernels: Kernels = Kernels(),
                               floors: RowFloors | None = None) -> int:
    """Peak activation bytes from norm1 to the gated attention residual (see module legend).

    floors: the row floors the chunks are realised with (None: `planned_floors`)."""
    _check(tokens, qkv_chunk=qkv_chunk, head_group=head_group)
    s, c, i, e = tokens, dims.hidden, dims.inner, dims.element_bytes
    x = h = s * c * e
    qkv = s * 3 * i * e
    attn_out = s * i * e
    requested = head_group if 0 < head_group < dims.heads else 0
    group = largest_head_group(dims.heads, requested, s)  # what `head_groups` realises
    norm1 = x + h + int(kernels.norm_temp_bytes * s * c)
    if not qkv_chunk and not requested:  # the upstream Attention.forward, h alive throughout
        a1 = x + h + linear_call_bytes(s, 3 * i, adapters.qkv, adapters.rank, e)
        a2 = x + h + qkv + _attention_call_bytes(s, dims.heads, dims, kernels)
        a3 = x + h + attn_out + linear_call_bytes(s, c, adapters.out_proj, adapters.rank, e)
        return max(norm1, a1, a2, a3)
    # upstream's block holds h through its attention call; the wrappers fill one output buffer
    # per chunked projection ([S, 3I] for qkv, [S, C] for out_proj), a chunk's call at a time
    m = largest_chunk_rows(s, qkv_chunk, _floors(floors, dims, adapters).split_floor(
        "qkv")) if qkv_chunk else s
    if m < s:
        b1 = x + h + qkv + linear_call_bytes(m, 3 * i, adapters.qkv, adapters.rank, e)
        b3 = x + h + attn_out + s * c * e + linear_call_bytes(m, c, adapters.out_proj,
                                                               adapters.rank, e)
    else:
        b1 = x + h + linear_call_bytes(s, 3 * i, adapters.qkv, adapters.rank, e)
        b3 = x + h + attn_out + linear_call_bytes(s, c, adapters.out_proj, adapters.rank, e)
    if group:  # one [S, I] output buffer, one group's temporaries at a time
        b2 = x + h + qkv + attn_out + _attention_call_bytes(s, group, dims, kernels)
    else:
        b2 = x + h + qkv + _attention_call_bytes(s, dims.heads, dims, kernels)
    return max(norm1, b1, b2, b3)


def _mlp_moments(rows: int, dims: BlockDims, adapters: Adapters, kernels: Kernels) -> int:
    """Peak bytes of fc1 -> SwiGLU -> fc2 on `rows` rows, x and h excluded."""
    c, f, e = dims.hidden, dims.ffn, dims.element_bytes
    fc1 = rows * 2 * f * e
    half = rows * f * e
    proj = linear_call_bytes(rows, c, adapters.fc2, adapters.rank, e)
    m1 = linear_call_bytes(rows, 2 * f, adapters.fc1, adapters.rank, e)
    if kernels.mlp == "twin":
        m2 = fc1 + 2 * half  # silu(gate) and silu(gate) * up both exist at the multiply
        m3 = half + proj  # fc1 was dropped when swiglu returned
    elif kernels.mlp == "comfy":
        m2 = fc1 + half  # silu(gate).mul_(up) reuses the silu buffer
        m3 = fc1 + half + proj  # linear_input_act's frame still holds fc1 during fc2
    else:  # comfy_int8: the product lives only as int8 inside the fused quantizer
        m2 = 0
        m3 = fc1 + rows * f + proj
    return max(m1, m2, m3)


def mlp_phase_peak_bytes(tokens: int, dims: BlockDims = BlockDims(), *, ffn_chunk: int = 0,
                         adapters: Adapters = Adapters(), kernels: Kernels = Kernels(),
                         chunked_block: bool | None = None,
                         floors: RowFloors | None = None) -> int:
    """Peak activation bytes from norm2 to the gated MLP residual (see module legend).

    Upstream's block keeps the attention phase's h while norm2 makes the new one (moment M0).
    chunked_block: kept for callers. The MLP's chunks (ffn_chunk > 0) are written back into
    h's rows (`wrappers.project_rows`), a chunk's fc1 -> SwiGLU -> fc2 at a time.
    """
    _check(tokens, ffn_chunk=ffn_chunk)
    s, e = tokens, dims.element_bytes
    x = h = s * dims.hidden * e
    m0 = x + 2 * h + int(kernels.norm_temp_bytes * s * dims.hidden)
    if not ffn_chunk:
        return max(m0, x + h + _mlp_moments(s, dims, adapters, kernels))
    floor = _floors(floors, dims, adapters).split_floor("ffn")
    rows = largest_chunk_rows(s, ffn_chunk, floor)
    if rows >= s:  # one chunk: the whole MLP, as unchunked
        return max(m0, x + h + _mlp_moments(s, dims, adapters, kernels))
    return max(m0, x + h + _mlp_moments(rows, dims, adapters, kernels))


@dataclass(frozen=True)
class BlockPeak:
    attention_bytes: int
    mlp_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.attention_bytes, self.mlp_bytes)

    @property
    def phase(self) -> str:
        return "attention" if self.attention_bytes >= self.mlp_bytes else "mlp"


def block_peak_bytes(tokens: int, dims: BlockDims = BlockDims(), *, ffn_chunk: int = 0,
                     qkv_chunk: int = 0, head_group: int = 0, adapters: Adapters = Adapters(),
                     kernels: Kernels = Kernels(), floors: RowFloors | None = None) -> BlockPeak:
    """Both phases' activation peaks of one block forward with these chunk settings."""
    chunked_block = bool(ffn_chunk or qkv_chunk or (0 < head_group < dims.heads))
    return BlockPeak(
        attention_phase_peak_bytes(tokens, dims, qkv_chunk=qkv_chunk, head_group=head_group,
                                   adapters=adapters, kernels=kernels, floors=floors),
        mlp_phase_peak_bytes(tokens, dims, ffn_chunk=ffn_chunk, adapters=adapters,
                             kernels=kernels, chunked_block=chunked_block, floors=floors))


def unchunked_block_peak_bytes(tokens: int, dims: BlockDims = BlockDims(), *,
                               adapters: Adapters = Adapters(),
                               kernels: Kernels = Kernels()) -> BlockPeak:
    """The plain tests/twin/upstream block: x and h alive in both phases, M0 included."""
    return block_peak_bytes(tokens, dims, adapters=adapters, kernels=kernels)


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
    _check(tokens)
    if not isinstance(free_bytes, int) or free_bytes < 0:
        raise ValueError(f"free_bytes must be a non-negative int, got {free_bytes!r}")
    budget = int(free_bytes * (1.0 - headroom_fraction)) - headroom_bytes
    resident = tokens * dims.hidden * dims.element_bytes  # x, already allocated
    floors = _floors(floors, dims, adapters)

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
                            if EXACT_MIN_HEADS <= g < dims.heads
                            and g * tiles >= MIN_QUERY_TILES_PER_CALL])
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
