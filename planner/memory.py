"""Memory model: bytes each GPU holds in each phase of the two-pass job.

Activation formulas count the tensors that are alive together at the worst moment of a DiT block,
as the block is written upstream (and in our twin):
- attention phase: residual x [S, C] and normed h [S, C] stay alive; qkv [S, 3I]; the attention
  output [S, I] (SDPA's flash layout makes the reshape a view on CUDA); an on-activation LoRA
  adapter adds one more [S, 3I] while the projection runs;
- MLP phase: x and h; fc1 output [S, 2F]; SwiGLU's silu temporary and product [S, F] each
  (ComfyUI's fused `linear_input_act` avoids the silu temporary: `fused_swiglu=True`);
  an on-activation LoRA on fc1 adds [S, 2F] while fc1 runs.
Chunked paths (see chunking/) bound the FFN intermediates and the LoRA extra by the chunk size,
free h before attention and write attention head groups into one preallocated output.
Legend: S tokens, C hidden, I = heads x head_dim, F ffn width, E bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import geometry

GiB = 1024**3


@dataclass(frozen=True)
class BlockDims:
    hidden: int = geometry.HIDDEN
    heads: int = geometry.HEADS
    head_dim: int = geometry.HEAD_DIM
    ffn: int = geometry.FFN
    element_bytes: int = 2

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class ChunkSettings:
    ffn_chunk: int = 0  # rows per FFN chunk, 0 = off
    qkv_chunk: int = 0  # rows per QKV/LoRA chunk, 0 = off
    head_group: int = 0  # heads per attention call, 0 = all heads at once

    @property
    def active(self) -> bool:
        return bool(self.ffn_chunk or self.qkv_chunk or self.head_group)


@dataclass(frozen=True)
class ActivationPeak:
    attention_bytes: int
    mlp_bytes: int
    persistent_bytes: int  # alive across all blocks (RoPE table, packed inputs)

    @property
    def peak_bytes(self) -> int:
        return max(self.attention_bytes, self.mlp_bytes) + self.persistent_bytes

    @property
    def phase(self) -> str:
        return "attention/QKV" if self.attention_bytes >= self.mlp_bytes else "FFN"


ROPE_BYTES_PER_TOKEN = 48 * 4 * 2  # [1, S, 1, 48, 2, 2] rotation table in bf16


def block_activation_peak(
    tokens: int,
    dims: BlockDims = BlockDims(),
    chunks: ChunkSettings = ChunkSettings(),
    *,
    lora_on_activations: bool = False,
    fused_swiglu: bool = False,
    dual_sage_root_extra_per_token: int = 0,
) -> ActivationPeak:
    """Peak bytes of one DiT block's activations for `tokens` rows."""
    e = dims.element_bytes
    c, i, f = dims.hidden * e, dims.inner * e, dims.ffn * e
    s = tokens
    residual = s * c
    # ---- attention phase
    normed = 0 if chunks.qkv_chunk else s * c  # the chunked path drops h once qkv is built
    qkv = s * 3 * i
    lora_qkv = 0
    if lora_on_activations:
        lora_qkv = (min(chunks.qkv_chunk, s) if chunks.qkv_chunk else s) * 3 * i
    projection_moment = residual + s * c + qkv + lora_qkv
    if chunks.head_group:
        group = min(chunks.head_group, dims.heads)
        attn_temp = s * i + s * group * dims.head_dim * e  # preallocated out + one group's out
    else:
        attn_temp = s * i
    attention_moment = residual + normed + qkv + attn_temp + s * dual_sage_root_extra_per_token
    attention = max(projection_moment, attention_moment)
    # ---- MLP phase
    rows = min(chunks.ffn_chunk, s) if chunks.ffn_chunk else s
    swiglu_temps = 1 if fused_swiglu else 2  # silu(gate) temporary + product, or product only
    fc1_moment = rows * 2 * f + (rows * 2 * f if lora_on_activations else 0)
    swiglu_moment = rows * 2 * f + rows * f * swiglu_temps
    fc2_moment = rows * f + rows * c
    mlp = residual + s * c + max(fc1_moment, swiglu_moment, fc2_moment)
    return ActivationPeak(attention, mlp, s * ROPE_BYTES_PER_TOKEN)


def unchunked_peak_per_token(dims: BlockDims = BlockDims(), lora: bool = False) -> int:
    return block_activation_peak(1, dims, lora_on_activations=lora).peak_bytes


def choose_chunks(
    free_bytes: int,
    tokens: int,
    dims: BlockDims = BlockDims(),
    *,
    lora_on_activations: bool = False,
    fused_swiglu: bool = False,
    dual_sage_root_extra_per_token: int = 0,
) -> ChunkSettings:
    """Cheapest chunking whose activation peak fits in `free_bytes` (no chunking if it fits).

    Chunks are large (>= 4096 rows) so the GEMMs stay efficient; the attention/QKV floor
    (qkv buffer + attention output) is what chunking cannot remove, so FFN chunks are sized to
    bring the MLP phase down to about that floor.
    """
    kwargs = dict(lora_on_activations=lora_on_activations, fused_swiglu=fused_swiglu,
                  dual_sage_root_extra_per_token=dual_sage_root_extra_per_token)
    if block_activation_peak(tokens, dims, **kwargs).peak_bytes <= free_bytes:
        return ChunkSettings()
    best = None
    for rows in (32768, 16384, 8192, 4096):
        settings = ChunkSettings(ffn_chunk=rows, qkv_chunk=rows, head_group=dims.heads // 4 or 1)
        if block_activation_peak(tokens, dims, settings, **kwargs).peak_bytes <= free_bytes:
            return settings
        best = settings
    return best  # the smallest chunks: the caller reports that even this does not fit
