"""Dual-Sage sizing and time model for the planner. Pure Python: no torch import.

All sizes in bytes, times in milliseconds, links in GB/s (1e9 bytes/s), compute in TFLOP/s.
The sharded call moves, per helper with `h` heads: q, k, v of those heads to the helper
(3*h*S*D elements) and their output back (h*S*D). The helper holds a ring of `ring_slots`
chunk buffers of `chunk_heads` heads each (q|k|v, the output overwrites q), plus one backend
output for a chunk; the root holds a contiguous send buffer and a receive buffer per helper.
"""

from __future__ import annotations

from collections.abc import Sequence

# the sharded call's own time model lives in common (the sequence mode compares against it)
from ..common.split_time import (  # noqa: F401  (Dual-Sage's names, re-exported)
    CALL_OVERHEAD_MS,
    DEFAULT_CHUNK_HEADS,
    HOST_CHUNK_HEADS,
    PEER_CHUNK_HEADS,
    attention_flops,
    chunk_heads_for,
    predict_split_ms,
)

DEFAULT_RING_SLOTS = 3
HOST_RELAY_SLOTS = 2
# the split must beat one GPU by this factor before it is switched on
MIN_TOKENS_MARGIN = 1.10


def helper_workspace_bytes(seq_len: int, helper_heads: int, head_dim: int, *,
                           chunk_heads: int = DEFAULT_CHUNK_HEADS,
                           ring_slots: int = DEFAULT_RING_SLOTS, element_bytes: int = 2) -> int:
    """Helper-GPU memory of one sharded call: the chunk ring plus one chunk's backend output."""
    heads = min(chunk_heads, helper_heads)
    slots = min(ring_slots, -(-helper_heads // heads))
    chunk_elems = heads * seq_len * head_dim
    lse_bytes = heads * seq_len * 4  # the backend's fp32 log-sum-exp rows
    return (slots * 3 * chunk_elems + chunk_elems) * element_bytes + lse_bytes


def root_extra_bytes(seq_len: int, helper_heads: int, head_dim: int, *,
                     element_bytes: int = 2) -> int:
    """Root-GPU memory on top of the plain call: contiguous send (q|k|v) and receive buffers."""
    return 4 * helper_heads * seq_len * head_dim * element_bytes


def pinned_host_bytes(seq_len: int, helper_heads: int, head_dim: int, *,
                      chunk_heads: int = DEFAULT_CHUNK_HEADS, element_bytes: int = 2) -> int:
    """Pinned host memory of the host relay per helper: two send and two return slots."""
    heads = min(chunk_heads, helper_heads)
    return HOST_RELAY_SLOTS * 4 * heads * seq_len * head_dim * element_bytes


def bytes_moved_per_call(seq_len: int, helper_heads: int, head_dim: int, *,
                         element_bytes: int = 2) -> int:
    """Bytes crossing the link per call for one helper: q, k, v there, the output back."""
    return 4 * helper_heads * seq_len * head_dim * element_bytes


def single_gpu_ms(seq_len: int, heads: int, head_dim: int, tflops: float) -> float:
    """Predicted time of the plain call on one GPU."""
    return attention_flops(seq_len, heads, head_dim) / (tflops * 1e9)


def choose_min_tokens(head_dim: int, split: Sequence[int], *, link_gbps: float,
                      tflops: Sequence[float], chunk_heads: int = DEFAULT_CHUNK_HEADS,
                      element_bytes: int = 2, host_relay: bool = False,
                      margin: float = MIN_TOKENS_MARGIN, max_tokens: int = 1 << 20) -> int:
    """Smallest S at which the sharded call beats one GPU by `margin` (max_tokens if never).

    Single-GPU time uses the root's throughput over all heads. Beyond the crossover the split
    only gets better (attention grows as S^2, transfers as S), so a binary search is enough.
    """
    heads = sum(split)

    def pays(s: int) -> bool:
        single = single_gpu_ms(s, heads, head_dim, tflops[0])
        split_ms = predict_split_ms(s, head_dim, split, link_gbps=link_gbps, tflops=tflops,
                                    chunk_heads=chunk_heads, element_bytes=element_bytes,
                                    host_relay=host_relay)
        return split_ms * margin <= single

    if not pays(max_tokens):
        return max_tokens
    low, high = 1, max_tokens
    while low < high:
        mid = (low + high) // 2
        if pays(mid):
            high = mid
        else:
            low = mid + 1
    return low
