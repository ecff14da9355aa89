"""Memory model: bytes each GPU holds in each phase of the two-pass job.

The per-block formulas live in `chunking/sizing.py` (one model of the block, used by the
chunking code too); they count the tensors alive together at the worst moment of a DiT block,
as the block is written upstream:
- attention phase: residual x [S, C] and normed h [S, C] stay alive; qkv [S, 3I]; the attention
  output [S, I] (SDPA's flash layout makes the reshape a view on CUDA); an on-activation LoRA
  adapter adds one more [S, 3I] while the projection runs;
- MLP phase: x and h; fc1 output [S, 2F]; the kernels of the real block (`kernels`, read
  through `comfy_seam.h3.block_kernels` as the run reads them): ComfyUI's `linear_input_act`
  holds fc1 while fc2 runs beside the SwiGLU product [S, F], or with INT8 weights fuses the
  product into an int8 [S, F] buffer; an on-activation LoRA on fc1 adds [S, 2F] while fc1 runs.
Chunked paths (see chunking/) bound the FFN intermediates and the LoRA extra by the chunk size,
free h before attention and write attention head groups into one preallocated output.
Legend: S tokens, C hidden, I = heads x head_dim, F ffn width, E bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunking import sizing as block_sizing

GiB = 1024**3


BlockDims = block_sizing.BlockDims  # one definition of a block's widths, shared with chunking/


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
    lora_rank: int = 128,
    kernels: block_sizing.Kernels = block_sizing.Kernels(),
    dual_sage_root_extra_per_token: int = 0,
) -> ActivationPeak:
    """Peak bytes of one DiT block's activations for `tokens` rows.

    The block itself is modelled once, in `chunking.sizing` (it follows the chunked code's
    allocations and the plain block's); this adds what the planner knows beyond one block:
    the RoPE table alive across all blocks and Dual-Sage's root-side gather of the helper heads.
    kernels: the block's (`Kernels.of`; the default is upstream H3's bf16 block).
    """
    adapters = (block_sizing.Adapters(rank=lora_rank, qkv=1, fc1=1) if lora_on_activations
                else block_sizing.Adapters())
    peak = block_sizing.block_peak_bytes(tokens, dims, ffn_chunk=chunks.ffn_chunk,
                                         qkv_chunk=chunks.qkv_chunk,
                                         head_group=chunks.head_group, adapters=adapters,
                                         kernels=kernels)
    attention = peak.attention_bytes + tokens * dual_sage_root_extra_per_token
    return ActivationPeak(attention, peak.mlp_bytes, tokens * ROPE_BYTES_PER_TOKEN)


def unchunked_peak_per_token(dims: BlockDims = BlockDims(), lora: bool = False) -> int:
    return block_activation_peak(1, dims, lora_on_activations=lora).peak_bytes


def choose_chunks(
    free_bytes: int,
    tokens: int,
    dims: BlockDims = BlockDims(),
    *,
    lora_on_activations: bool = False,
    lora_rank: int = 128,
    kernels: block_sizing.Kernels = block_sizing.Kernels(),
    dual_sage_root_extra_per_token: int = 0,
) -> ChunkSettings:
    """Cheapest chunking whose activation peak fits in `free_bytes` (no chunking if it fits).

    Chunks are large (>= 4096 rows) so the GEMMs stay efficient; the attention/QKV floor
    (qkv buffer + attention output) is what chunking cannot remove, so FFN chunks are sized to
    bring the MLP phase down to about that floor.
    """
    kwargs = dict(lora_on_activations=lora_on_activations, lora_rank=lora_rank,
                  kernels=kernels,
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
