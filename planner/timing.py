"""Time model: FLOPs over effective throughput, bytes over link bandwidth.

Per DiT block at S tokens: four linears (`geometry.linear_flops_per_token * S`) and one attention
call (`4 S^2 d H`). Dual-Sage moves a share of the heads to helper GPUs (its time model lives in
`dual_sage/sizing.py`). Streaming a
block's weights costs nothing while the copy (on its own stream) is shorter than the previous
block's compute, and the difference when it is longer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import geometry
from ..dual_sage import sizing as dual_sage_sizing
from .hardware import GB, GPUSpec, LinkSpec


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


def _link_args(link: LinkSpec) -> dict:
    # a host relay crosses the bus twice; dual_sage.sizing counts the two hops itself
    if link.peer_access:
        return {"link_gbps": link.peer_gbs, "host_relay": False,
                "chunk_heads": dual_sage_sizing.chunk_heads_for(host_relay=False)}
    return {"link_gbps": link.host_pinned_gbs, "host_relay": True,
            "chunk_heads": dual_sage_sizing.chunk_heads_for(host_relay=True)}


def dual_sage_attention_time_s(tokens: int, root: GPUSpec, helpers: list[GPUSpec],
                               link: LinkSpec, split: tuple[int, ...], *,
                               head_dim: int = geometry.HEAD_DIM, element_bytes: int = 2,
                               quantized: bool = False) -> float:
    """One attention call with `split[0]` heads on the root and `split[1:]` on the helpers.

    Dual-Sage's own model (`dual_sage.sizing.predict_split_ms`), plus the root's gather of the
    helper heads' strided q, k, v into contiguous send buffers before its own attention: at
    35k tokens on an H200 that gather is what separates 1.86x from 2x.
    """
    def rate(gpu: GPUSpec) -> float:
        if quantized and gpu.int8_attention_tflops:
            return gpu.int8_attention_tflops
        return gpu.attention_tflops

    split_ms = dual_sage_sizing.predict_split_ms(
        tokens, head_dim, split, tflops=[rate(root)] + [rate(g) for g in helpers],
        element_bytes=element_bytes, **_link_args(link))
    gather_bytes = 2 * 3 * sum(split[1:]) * head_dim * tokens * element_bytes  # read + write
    return split_ms / 1e3 + gather_bytes / (root.memory_bandwidth_gbs * GB)


def choose_min_tokens(root: GPUSpec, helpers: list[GPUSpec], link: LinkSpec,
                      split: tuple[int, ...]) -> int:
    """Smallest S at which the split call beats the root alone (never slower below it)."""
    return dual_sage_sizing.choose_min_tokens(
        geometry.HEAD_DIM, split, tflops=[root.attention_tflops]
        + [g.attention_tflops for g in helpers], **_link_args(link))


def block_copy_time_s(block_bytes: int, link: LinkSpec, pinned: bool = True) -> float:
    rate = link.host_pinned_gbs if pinned else link.host_pageable_gbs
    return block_bytes / (rate * GB)

