"""Time model: FLOPs over effective rates, bytes over bandwidths.

Per DiT block at S tokens on one GPU (`sequence.sizing.one_gpu_block_ms`, the model the
sequence mode shares): the four linears (`geometry.linear_flops_per_token * S`) at the GEMM
rate of the DiT's weights (INT8 GEMMs for the official INT8 checkpoint where the card has them,
else bf16/fp16), the elementwise traffic (norms, modulation, RoPE, SwiGLU, gates:
`sequence.sizing.ELEMENTWISE_ELEMENTS_PER_TOKEN` bf16 values per token) at the memory bandwidth,
and one attention call (4 S^2 d H) at the rate of the kernel ComfyUI runs. Dual-Sage's call
model lives in `dual_sage/sizing.py`, the sequence mode's in `sequence/sizing.py`.

Streamed weights cost the part of their copy that no compute hides: ComfyUI's DynamicVRAM stages
one block ahead (each copy hides behind one block), the pack's streamer spreads resident blocks
among the streamed ones (`offload.sizing`). A job adds the latent upscale and the video decode.

Calibration (`profiles.json` names each rate's source): GEMM and attention rates measured on the
lab's H200s, the RTX 5090's fitted on its published run; `dev/bench/bench_time_model.py` measures
the H200's rates again and compares them with these.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import geometry
from ..dual_sage import sizing as dual_sage_sizing
from ..sequence import sizing as sequence_sizing
from ..sequence.sizing import link_speed  # the one conversion (the runtime uses it too)
from .hardware import GB, GPUSpec, LinkSpec

UPSCALER_CONV_EFFICIENCY = 0.5  # 3D convs against the card's GEMM rate: an estimate
UPSCALER_RESBLOCKS = 12  # per resolution (before and after its resize)


@dataclass(frozen=True, kw_only=True)
class GPURates:
    """One GPU's rates for this job: the DiT's GEMMs, the attention kernel, its memory."""

    gemm_tflops: float
    gemm_kind: str  # "int8" | "bf16" | "fp16"
    attention_tflops: float
    attention_kernel: str  # the kernel timed (SDPA's when the card lacks the one asked for)
    memory_gbs: float

    def speed(self) -> sequence_sizing.GPUSpeed:
        return sequence_sizing.GPUSpeed(self.gemm_tflops, self.attention_tflops, self.memory_gbs)


def gpu_rates(gpu: GPUSpec, *, dit_dtype: str, attention: str) -> GPURates:
    gemm, kind = gpu.gemm_rate(dit_dtype)
    rate, kernel = gpu.attention_rate(attention)
    return GPURates(gemm_tflops=gemm, gemm_kind=kind, attention_tflops=rate,
                    attention_kernel=kernel, memory_gbs=gpu.memory_bandwidth_gbs)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One sampling step of one pass in the mode that runs it."""

    mode: str  # "off" (one GPU) | "heads" | "sequence" | "cfg" (CFG Split's clones)
    block_s: float  # one DiT block's compute (the split modes: the slowest GPU and the link)
    streaming_s: float  # weight copies no compute hides
    # model calls one after another per step: 2 at CFG above 1 (cond, uncond) unless CFG Split
    # runs them side by side on two GPUs ("cfg": 1, its block_s the slower GPU's)
    calls: int = 1

    @property
    def total_s(self) -> float:
        return self.calls * (geometry.BLOCKS * self.block_s + self.streaming_s)


def one_gpu_block_s(tokens: int, rates: GPURates) -> float:
    return sequence_sizing.one_gpu_block_ms(tokens, rates.speed()) / 1e3


def heads_block_s(tokens: int, root: GPURates, helpers: list[GPURates], link: LinkSpec,
                  split: tuple[int, ...]) -> float:
    """The root's rows work on all rows plus Dual-Sage's sharded attention call."""
    rows = sequence_sizing.rows_ms(tokens, root.speed()) / 1e3
    return rows + dual_sage_attention_s(tokens, root, helpers, link, split)


def sequence_block_s(tokens: int, gpus: list[GPURates], heads: tuple[int, ...],
                     link: LinkSpec, *, row_weights: tuple[float, ...],
                     helper_streamed_block_bytes: int) -> float:
    return sequence_sizing.sequence_block_ms(
        tokens, [g.speed() for g in gpus], heads, link_speed(link), row_weights=row_weights,
        streamed_block_bytes=helper_streamed_block_bytes) / 1e3


def _link_args(link: LinkSpec) -> dict:
    # a host relay crosses the bus twice; dual_sage.sizing counts the two hops itself
    if link.peer_access:
        return {"link_gbps": link.peer_gbs, "host_relay": False,
                "chunk_heads": dual_sage_sizing.chunk_heads_for(host_relay=False)}
    return {"link_gbps": link.host_pinned_gbs, "host_relay": True,
            "chunk_heads": dual_sage_sizing.chunk_heads_for(host_relay=True)}


def dual_sage_attention_s(tokens: int, root: GPURates, helpers: list[GPURates],
                          link: LinkSpec, split: tuple[int, ...], *,
                          head_dim: int = geometry.HEAD_DIM, element_bytes: int = 2) -> float:
    """One attention call with `split[0]` heads on the root and `split[1:]` on the helpers.

    Dual-Sage's own model (`dual_sage.sizing.predict_split_ms`), plus the root's gather of the
    helper heads' strided q, k, v into contiguous send buffers before its own attention: at
    35k tokens on an H200 that gather is what separates 1.86x from 2x.
    """
    split_ms = dual_sage_sizing.predict_split_ms(
        tokens, head_dim, split, tflops=[root.attention_tflops]
        + [g.attention_tflops for g in helpers], element_bytes=element_bytes,
        **_link_args(link))
    gather_bytes = 2 * 3 * sum(split[1:]) * head_dim * tokens * element_bytes  # read + write
    return split_ms / 1e3 + gather_bytes / (root.memory_gbs * GB)


def attention_s(tokens: int, rates: GPURates, heads: int = geometry.HEADS) -> float:
    return geometry.attention_flops(tokens, heads=heads) / (rates.attention_tflops * 1e12)


def split_heads_by_throughput(rates: list[float], heads: int = geometry.HEADS
                              ) -> tuple[int, ...]:
    """Heads per GPU proportional to attention throughput (root first), each >= 1."""
    total = sum(rates)
    raw = [heads * r / total for r in rates]
    split = [max(1, int(x)) for x in raw]
    # hand the rounding remainder to the GPUs with the largest fractional parts
    order = sorted(range(len(raw)), key=lambda k: raw[k] - int(raw[k]), reverse=True)
    k = 0
    while sum(split) < heads:
        split[order[k % len(order)]] += 1
        k += 1
    while sum(split) > heads:
        j = max(range(len(split)), key=lambda n: split[n])
        split[j] -= 1
    return tuple(split)


def choose_min_tokens(root: GPURates, helpers: list[GPURates], link: LinkSpec,
                      split: tuple[int, ...]) -> int:
    """Smallest S at which the split call beats the root alone (never slower below it)."""
    return dual_sage_sizing.choose_min_tokens(
        geometry.HEAD_DIM, split, tflops=[root.attention_tflops]
        + [g.attention_tflops for g in helpers], **_link_args(link))


def block_copy_s(block_bytes: int, link: LinkSpec, *, pinned_fraction: float = 1.0) -> float:
    """Host -> GPU copy of one block, `pinned_fraction` of the streamed blocks pinned."""
    pinned = block_bytes / (link.host_pinned_gbs * GB)
    pageable = block_bytes / (link.host_pageable_gbs * GB)
    return pinned_fraction * pinned + (1.0 - pinned_fraction) * pageable


def streaming_s(*, comfy_streams: bool, streamed: int, block_s: float, copy_s: float) -> float:
    """Copy time per step that no compute hides, for the loader that streams."""
    from ..offload import sizing as offload_sizing

    if streamed <= 0:
        return 0.0
    if comfy_streams:
        # DynamicVRAM stages one block ahead: each copy hides behind one block's compute
        return offload_sizing.one_ahead_overhead_seconds(
            streamed=streamed, block_compute_s=block_s, block_copy_s=copy_s)
    # the pack's streamer spreads resident blocks among the streamed ones: each copy has
    # blocks / streamed blocks of compute to hide in
    return offload_sizing.step_overhead_seconds(
        blocks=geometry.BLOCKS, streamed=streamed, block_compute_s=block_s, block_copy_s=copy_s)


def upscale_s(pass1: geometry.PassGeometry, pass2: geometry.PassGeometry, gpu: GPUSpec
              ) -> float:
    """The learned latent upscaler (conv 24->512, 12 residual blocks of two 3x3x3 convs at the
    input size, 12 at the output size): an estimate at half the card's GEMM rate."""
    def cells(p: geometry.PassGeometry) -> int:
        _, _, t, h, w = p.latent
        return t * h * w

    per_cell = 2 * 27 * 512 * 512 * 2 * UPSCALER_RESBLOCKS  # two convs per residual block
    flops = per_cell * (cells(pass1) + cells(pass2))
    return flops / (gpu.matmul_tflops * UPSCALER_CONV_EFFICIENCY * 1e12)


@dataclass(frozen=True, kw_only=True)
class JobTime:
    """Stage output: the whole job, both passes and every step, the upscale and the decode
    (model loading and the prompt's text encoding, once per prompt, are not counted)."""

    pass1_steps: int
    pass1_step_s: float
    pass2_steps: int
    pass2_step_s: float
    upscale_s: float
    decode_s: float

    @property
    def pass1_s(self) -> float:
        return self.pass1_steps * self.pass1_step_s

    @property
    def pass2_s(self) -> float:
        return self.pass2_steps * self.pass2_step_s

    @property
    def total_s(self) -> float:
        return self.pass1_s + self.pass2_s + self.upscale_s + self.decode_s


def duration(seconds: float) -> str:
    """'0.4 s', '48 s', '12.5 min', '1 h 32 min'."""
    if seconds < 1:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min"
