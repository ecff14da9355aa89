"""Activation memory of one H3 DiT block, chunked or not: pure Python, no torch.

The one model of the block's memory that chunking, the sequence split and the planner share
(`chunking.sizing` adds the choice of chunks).

The planner calls these before any weight moves; the chunk wrappers (`wrappers.py`) run the
same `rows.row_chunks`, so the sizes they run are the sizes predicted here. Every formula lists the
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
from typing import Any

from ..comfy_seam import h3 as seam_h3
from ..common import geometry
from .row_exactness import RowFloors, floors_or_planned
from .rows import largest_chunk_rows, largest_head_group

MLP_KERNELS = ("twin", "comfy", "comfy_int8")
LSE_BYTES = 4  # SDPA's logsumexp is fp32 [H, S]
_UPSTREAM = seam_h3.block_kernels()  # upstream H3's block, nothing loaded: the defaults


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

    mlp: "comfy" (`linear_input_act` eager SwiGLU: silu then in-place multiply, fc1 held during
    fc2), "comfy_int8" (SwiGLU fused into the INT8 activation quantizer: an int8 [S,F] buffer),
    "twin" (the test twin's: silu temporary, fc1 freed before fc2; tests and benches of the twin
    name it). attention_output_copy: the attention backend's [1,H,S,D] output needs a copy to
    become [1,S,H*D] (False for SDPA flash/efficient on CUDA). norm_temp_bytes: bytes of
    temporaries per element of [S,C] while RMSNorm runs, beyond its output (0 for a fused
    kernel; a composite bf16 RMSNorm upcasts to fp32 on the way).

    The defaults are upstream H3's block in bf16, as the seam reads it (`of`); the run reads
    the loaded block's through the same seam function.
    """

    mlp: str = _UPSTREAM.mlp
    attention_output_copy: bool = _UPSTREAM.attention_output_copy
    norm_temp_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.mlp not in MLP_KERNELS:
            raise ValueError(f"mlp kernel {self.mlp!r} is unknown; use one of {MLP_KERNELS}")

    @classmethod
    def of(cls, model: Any = None, *, weight_format: str = "bfloat16") -> Kernels:
        """The kernels of a loaded model's block, or (None) of upstream H3's block with DiT
        linears of `weight_format` (`comfy_seam.h3.block_kernels`: the one answer the
        chunking's run-time sizing and the planner both use)."""
        found = seam_h3.block_kernels(model, weight_format=weight_format)
        return cls(mlp=found.mlp, attention_output_copy=found.attention_output_copy)


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


def check_sizes(tokens: int, **chunks: int) -> None:
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
    check_sizes(tokens, qkv_chunk=qkv_chunk, head_group=head_group)
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
    m = largest_chunk_rows(s, qkv_chunk, floors_or_planned(floors, dims, adapters).split_floor(
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
    check_sizes(tokens, ffn_chunk=ffn_chunk)
    s, e = tokens, dims.element_bytes
    x = h = s * dims.hidden * e
    m0 = x + 2 * h + int(kernels.norm_temp_bytes * s * dims.hidden)
    if not ffn_chunk:
        return max(m0, x + h + _mlp_moments(s, dims, adapters, kernels))
    floor = floors_or_planned(floors, dims, adapters).split_floor("ffn")
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
