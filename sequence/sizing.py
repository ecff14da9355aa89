"""Sequence-parallel time and memory model. Pure Python (no torch): the planner imports it.

Time per DiT block (milliseconds), at S tokens over N GPUs with row shares s_k and head shares
h_k (E bytes per element, D head dim, I = H*D):
- one GPU: the four linears (`geometry.linear_flops_per_token`), attention (4 S^2 D H) and the
  per-token elementwise traffic (norms, modulation, RoPE, SwiGLU, gates) over memory bandwidth;
- sequence: the slowest GPU's row work (linears, elementwise, the q|k|v gathers and the output
  assembly on s_k rows), then the first chunk's transfer, then the slowest of each GPU's
  attention over its h_k heads and its link traffic (the rest of the chunks travel while the
  previous ones are attended), then the last chunk's return; never below the host time to queue
  the block, and a helper streaming its weights waits for the copy when it is the longer;
- heads (Dual-Sage): the root's rows work on all S rows plus Dual-Sage's own call model.
Link traffic per GPU k: its rows of the other GPUs' heads out (s_k * 3 * (H - h_k) * D * E) and
the other GPUs' rows of its heads' output back (S - s_k) * h_k * D * E; a host relay crosses the
bus twice.

Memory per GPU (bytes): the residual rows (the root keeps the model's whole [S, C] tensor), and
the worst moment of the block: the attention phase (its attention buffers [S, 3, h_k, D], the qkv
projection of its rows and the pieces gathered for the others) or the MLP phase on s_k rows
(`chunking.sizing`), whichever is larger; plus the helper's weights (a replica, or K + 1 slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..common import block_memory as block_sizing
from ..common import geometry
from ..common.split import split_by_weights
from ..common.split_time import predict_split_ms

# heads per attention call within a device's share (2x H200, full PASS2 steps, bit-identical
# each way; `docs/BENCHMARKS.md`). Over peer copies 7 gave 1.93x / 1.90x at 68,706 / 35,305
# tokens against 1.91x / 1.87x with 4 and 1.93x / 1.88x with 14. Through the host relay 4 gave
# 1.92x against 1.91x with 7 (larger chunks lengthen each relay hop, as for Dual-Sage). Never
# below 4, where flash's exact range starts.
PEER_CHUNK_HEADS = 7
HOST_CHUNK_HEADS = 4
DEFAULT_CHUNK_HEADS = PEER_CHUNK_HEADS


def chunk_heads_for(host_relay: bool) -> int:
    """The default heads per attention call on this transport."""
    return HOST_CHUNK_HEADS if host_relay else PEER_CHUNK_HEADS

ELEMENTWISE_ELEMENTS_PER_TOKEN = 14 * geometry.HIDDEN + 4 * geometry.INNER + 3 * geometry.FFN
# host time to queue one GPU's share of one block (launches, events, Python), order measured for
# Dual-Sage's call (0.35 ms for ~10 ops per chunk); the block loop queues ~4x that per GPU
HOST_MS_PER_GPU_BLOCK = 1.5
DEFAULT_MARGIN = 1.05  # a split mode must beat one GPU by this factor to be picked


@dataclass(frozen=True)
class GPUSpeed:
    """Effective rates of one GPU for H3's shapes (the planner's GPUSpec carries the same)."""

    matmul_tflops: float = 700.0
    attention_tflops: float = 600.0
    memory_gbs: float = 4300.0


@dataclass(frozen=True)
class LinkSpeed:
    gbps: float = 300.0  # peer copy, or pinned host <-> GPU for a relay
    host_relay: bool = False
    host_gbps: float = 50.0  # pinned host -> GPU (weights streamed to a helper)


def gpu_speed(gpu: Any, attention: bool | str = False) -> GPUSpeed:
    """One GPU's rates from a hardware description (the planner's `GPUSpec`: `matmul_tflops`,
    `memory_bandwidth_gbs`, `attention_rate(kernel)`, `attention_tflops`,
    `int8_attention_tflops`): bf16 GEMMs, the attention kernel (`attention` a kernel name, or
    the old flag: True = the fastest INT8-QK kernel), memory bandwidth. The planner and the
    runtime's `config_from_plan` convert with this one function."""
    if isinstance(attention, str):
        rate = gpu.attention_rate(attention)[0]
    else:
        rate = gpu.int8_attention_tflops if attention and gpu.int8_attention_tflops else \
            gpu.attention_tflops
    return GPUSpeed(gpu.matmul_tflops, rate, gpu.memory_bandwidth_gbs)


def link_speed(link: Any) -> LinkSpeed:
    """The link between the GPUs from a hardware description (the planner's `LinkSpec`:
    `peer_access`, `peer_gbs`, `host_pinned_gbs`): peer copies, else the pinned host relay."""
    if link.peer_access:
        return LinkSpeed(link.peer_gbs, False, link.host_pinned_gbs)
    return LinkSpeed(link.host_pinned_gbs, True, link.host_pinned_gbs)


def _ms(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e9)


def _bytes_ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e6)


def rows_ms(rows: int, gpu: GPUSpeed, *, element_bytes: int = 2) -> float:
    """Linears plus elementwise traffic of `rows` tokens on one GPU."""
    return (_ms(geometry.linear_flops_per_token() * rows, gpu.matmul_tflops)
            + _bytes_ms(ELEMENTWISE_ELEMENTS_PER_TOKEN * element_bytes * rows, gpu.memory_gbs))


def attention_ms(seq_len: int, heads: int, gpu: GPUSpeed) -> float:
    return _ms(geometry.attention_flops(seq_len, heads=heads), gpu.attention_tflops)


def one_gpu_block_ms(seq_len: int, gpu: GPUSpeed, *, element_bytes: int = 2) -> float:
    return rows_ms(seq_len, gpu, element_bytes=element_bytes) + \
        attention_ms(seq_len, geometry.HEADS, gpu)


def split_counts(total: int, weights: Sequence[float]) -> list[int]:
    """The rows or heads per device (`common.split`, the rounding the runtime split uses)."""
    return list(split_by_weights(total, weights))


def sequence_block_ms(seq_len: int, gpus: Sequence[GPUSpeed], head_counts: Sequence[int],
                      link: LinkSpeed, *, row_weights: Sequence[float] | None = None,
                      chunk_heads: int | None = None, element_bytes: int = 2,
                      streamed_block_bytes: int = 0) -> float:
    """Predicted time of one block split over `gpus` (see the module docstring)."""
    n = len(gpus)
    weights = row_weights if row_weights is not None else [1.0] * n
    rows = split_counts(seq_len, weights)
    heads, d, e = sum(head_counts), geometry.HEAD_DIM, element_bytes
    hops = 2 if link.host_relay else 1
    row_work = []
    for k in range(n):
        # gathers read and write the qkv rows once; the assembly the attention output rows
        copies = 2 * rows[k] * (3 + 1) * heads * d * e
        row_work.append(rows_ms(rows[k], gpus[k], element_bytes=e)
                        + _bytes_ms(copies, gpus[k].memory_gbs))
    attend, traffic = [], []
    for k in range(n):
        attend.append(attention_ms(seq_len, head_counts[k], gpus[k]))
        out = rows[k] * 3 * (heads - head_counts[k]) * d * e \
            + (seq_len - rows[k]) * head_counts[k] * d * e
        # a relay's two hops run on different engines, piece after piece: the bus time counts once
        traffic.append(_bytes_ms(out, link.gbps))
    g = min(chunk_heads or chunk_heads_for(link.host_relay), min(head_counts))
    first = hops * _bytes_ms(max(rows) * 3 * g * d * e, link.gbps)
    last = hops * _bytes_ms(max(rows) * g * d * e, link.gbps)
    gpu_ms = max(row_work) + first + max(max(a, t) for a, t in zip(attend, traffic,
                                                                    strict=True)) + last
    host_ms = HOST_MS_PER_GPU_BLOCK * n
    block = max(gpu_ms, host_ms)
    if streamed_block_bytes:
        block = max(block, _bytes_ms(streamed_block_bytes, link.host_gbps))
    return block


def heads_block_ms(seq_len: int, gpus: Sequence[GPUSpeed], head_counts: Sequence[int],
                   link: LinkSpeed, *, element_bytes: int = 2) -> float:
    """Dual-Sage: the root's rows work on all rows plus the sharded attention call."""
    root = gpus[0]
    call = predict_split_ms(
        seq_len, geometry.HEAD_DIM, list(head_counts), link_gbps=link.gbps,
        tflops=[g.attention_tflops for g in gpus], element_bytes=element_bytes,
        host_relay=link.host_relay)
    gather = 2 * 3 * sum(head_counts[1:]) * geometry.HEAD_DIM * seq_len * element_bytes
    return rows_ms(seq_len, root, element_bytes=element_bytes) + call + \
        _bytes_ms(gather, root.memory_gbs)


# ---------------------------------------------------------------------- memory
@dataclass(frozen=True)
class DeviceMemory:
    """Activation bytes of one GPU in the sequence mode (weights counted separately)."""

    residual: int
    attention_phase: int
    mlp_phase: int

    @property
    def peak(self) -> int:
        return self.residual + max(self.attention_phase, self.mlp_phase)


def sequence_memory(seq_len: int, head_counts: Sequence[int], *,
                    row_weights: Sequence[float] | None = None,
                    dims: block_sizing.BlockDims = block_sizing.BlockDims(),
                    adapters: block_sizing.Adapters = block_sizing.Adapters(),
                    kernels: block_sizing.Kernels = block_sizing.Kernels(),
                    ffn_chunk: int = 0, chunk_heads: int = DEFAULT_CHUNK_HEADS
                    ) -> list[DeviceMemory]:
    """Per-GPU activation bytes (root first) of the split block loop at `seq_len` tokens."""
    n = len(head_counts)
    rows = split_counts(seq_len, row_weights if row_weights is not None else [1.0] * n)
    heads, d, e, c = dims.heads, dims.head_dim, dims.element_bytes, dims.hidden
    out = []
    for k in range(n):
        s = rows[k]
        residual = (seq_len if k == 0 else s) * c * e  # the root keeps the model's [S, C]
        dest = seq_len * 3 * head_counts[k] * d * e
        qkv = block_sizing.linear_call_bytes(s, 3 * dims.inner, adapters.qkv, adapters.rank, e)
        pieces = s * 3 * (heads - head_counts[k]) * d * e
        g = min(max(chunk_heads, 1), head_counts[k])
        h = s * c * e
        # upstream's block runs on the share: its frames hold the attention input h and the
        # q|k|v projection (ComfyUI's Attention also a clone of v; the twin's does not) while
        # the override exchanges heads
        held = h + s * 3 * dims.inner * e + (0 if kernels.mlp == "twin" else s * dims.inner * e)
        # the override's buffers: its heads over all rows, its output rows, the returned pieces
        buffers = dest + s * dims.inner * e + s * (heads - head_counts[k]) * d * e
        projecting = h + qkv  # qkv_proj writes while h exists
        gathering = held + buffers + pieces
        attending = held + buffers + seq_len * g * d * e + g * seq_len * block_sizing.LSE_BYTES
        attention_phase = max(projecting, gathering, attending)
        mlp = block_sizing.mlp_phase_peak_bytes(s, dims, ffn_chunk=ffn_chunk, adapters=adapters,
                                                kernels=kernels) - s * c * e
        out.append(DeviceMemory(residual, attention_phase, mlp))
    return out


def helper_weight_bytes(block_bytes: int, blocks: int, *, replica: bool,
                        lookahead: int = 2) -> int:
    """A helper's DiT weights: all blocks (replica) or K + 1 streaming slots."""
    return blocks * block_bytes if replica else min(lookahead + 1, blocks) * block_bytes
