"""Time model: FLOPs over effective throughput, bytes over link bandwidth.

Per DiT block at S tokens: four linears (`geometry.linear_flops_per_token * S`) and one attention
call (`4 S^2 d H`). Dual-Sage moves a share of the heads to helper GPUs: the root attends its
heads while the helper's q, k, v travel in chunks, are attended on the helper and come back; with
copies overlapped the call takes the longer of the two sides plus one chunk's latency. Streaming a
block's weights costs nothing while the copy (on its own stream) is shorter than the previous
block's compute, and the difference when it is longer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import geometry
from .hardware import GB, GPUSpec, LinkSpec

TRANSFER_CHUNKS = 4  # head chunks per call (latency of one chunk is not hidden)


@dataclass(frozen=True)
class BlockTime:
    linear_s: float
    attention_s: float

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s


def linear_time_s(tokens: int, gpu: GPUSpec) -> float:
    return geometry.linear_flops_per_token() * tokens / (gpu.matmul_tflops * 1e12)


def attention_time_s(tokens: int, gpu: GPUSpec, heads: int = geometry.HEADS,
                     quantized: bool = False) -> float:
    rate = gpu.int8_attention_tflops if quantized and gpu.int8_attention_tflops else \
        gpu.attention_tflops
    return geometry.attention_flops(tokens, heads=heads) / (rate * 1e12)


def split_heads_by_throughput(gpus: list[GPUSpec], heads: int = geometry.HEADS) -> tuple[int, ...]:
    """Heads per GPU proportional to attention throughput (root first), each >= 1."""
    rates = [g.attention_tflops for g in gpus]
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


def dual_sage_attention_time_s(tokens: int, root: GPUSpec, helpers: list[GPUSpec],
                               link: LinkSpec, split: tuple[int, ...], *,
                               head_dim: int = geometry.HEAD_DIM, element_bytes: int = 2,
                               quantized: bool = False) -> float:
    """One attention call with `split[0]` heads on the root and `split[1:]` on the helpers."""
    root_s = attention_time_s(tokens, root, split[0], quantized)
    # the root gathers the helpers' q, k, v into contiguous buffers before its own attention
    gather_bytes = 2 * 3 * sum(split[1:]) * head_dim * tokens * element_bytes  # read + write
    root_s += gather_bytes / (root.memory_bandwidth_gbs * GB)
    slowest = 0.0
    bandwidth = link.helper_gbs * GB
    for gpu, heads in zip(helpers, split[1:], strict=True):
        send = 3 * heads * head_dim * tokens * element_bytes / bandwidth
        back = heads * head_dim * tokens * element_bytes / bandwidth
        compute = attention_time_s(tokens, gpu, heads, quantized)
        # chunks overlap: the longer of compute and traffic, plus one chunk's latency each way
        side = max(compute, send + back) + (send + back) / TRANSFER_CHUNKS
        slowest = max(slowest, side)
    return max(root_s, slowest)


def choose_min_tokens(root: GPUSpec, helpers: list[GPUSpec], link: LinkSpec,
                      split: tuple[int, ...], *, min_gain: float = 1.05) -> int:
    """Smallest S at which the split call beats the root alone by `min_gain` (never slower)."""
    s = 256
    while s < 1 << 22:
        single = attention_time_s(s, root)
        if single / dual_sage_attention_time_s(s, root, helpers, link, split) >= min_gain:
            return s
        s = int(s * 1.25)
    return 1 << 22


def block_copy_time_s(block_bytes: int, link: LinkSpec, pinned: bool = True) -> float:
    rate = link.host_pinned_gbs if pinned else link.host_pageable_gbs
    return block_bytes / (rate * GB)


def streaming_overhead_s(block_compute_s: float, copy_s: float) -> float:
    """Per streamed block: the part of the copy the previous block's compute does not hide."""
    return max(0.0, copy_s - block_compute_s)
