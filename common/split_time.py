"""The time of one head-sharded attention call over the root and its helpers (Dual-Sage's model).

Pure Python, no torch. Dual-Sage sizes its calls and chooses `min_tokens` with it
(`dual_sage.sizing`); the sequence mode compares its own block time against it when it picks
the per-step mode (`sequence.sizing.heads_block_ms`); the planner does both. All times in
milliseconds, links in GB/s (1e9 bytes/s), compute in TFLOP/s.
"""

from __future__ import annotations

from collections.abc import Sequence

# heads per helper chunk, by transport (2x H200, ComfyUI's attention function, 35k-102k
# tokens): through the host relay 4 is best (7: -3 to -6%); over peer copies 14 beats 4 by 2-3%
# (each chunk is one call of ComfyUI's function: fewer calls save more than the overlap they
# lose). Peer copies were measured on NVLink only; PCIe peer links are unmeasured.
HOST_CHUNK_HEADS = 4
PEER_CHUNK_HEADS = 14
DEFAULT_CHUNK_HEADS = HOST_CHUNK_HEADS


def chunk_heads_for(host_relay: bool) -> int:
    """The default heads per helper chunk on this transport."""
    return HOST_CHUNK_HEADS if host_relay else PEER_CHUNK_HEADS


# launch and event overhead of one sharded call (python + ~10 ops per chunk), measured order
CALL_OVERHEAD_MS = 0.35


def attention_flops(seq_len: int, heads: int, head_dim: int) -> float:
    """Non-causal attention: QK^T and PV, 2 flops per multiply-add: 4 * S^2 * D * H."""
    return 4.0 * seq_len * seq_len * head_dim * heads


def predict_split_ms(seq_len: int, head_dim: int, split: Sequence[int], *,
                     link_gbps: float, tflops: Sequence[float],
                     chunk_heads: int = DEFAULT_CHUNK_HEADS, element_bytes: int = 2,
                     host_relay: bool = False) -> float:
    """Predicted time of one sharded call. `split[0]`/`tflops[0]` are the root's.

    The root attends its heads while each helper receives chunk by chunk: a helper finishes one
    chunk's transfer latency after the first chunk starts, plus its attention (transfers overlap
    with it), plus the last chunk's return. A host relay crosses the host twice (two hops).
    """
    if len(split) != len(tflops):
        raise ValueError(f"split {tuple(split)} and tflops {tuple(tflops)} need one entry per "
                         "device")
    hops = 2 if host_relay else 1
    root_ms = attention_flops(seq_len, split[0], head_dim) / (tflops[0] * 1e9)
    finish = root_ms
    for heads, rate in zip(split[1:], tflops[1:], strict=True):
        if heads == 0:
            continue
        chunk = min(chunk_heads, heads)
        chunk_in_ms = hops * 3 * chunk * seq_len * head_dim * element_bytes / (link_gbps * 1e6)
        chunk_out_ms = chunk_in_ms / 3
        total_in_ms = hops * 3 * heads * seq_len * head_dim * element_bytes / (link_gbps * 1e6)
        attend_ms = attention_flops(seq_len, heads, head_dim) / (rate * 1e9)
        helper_ms = chunk_in_ms + max(attend_ms, total_in_ms - chunk_in_ms) + chunk_out_ms
        finish = max(finish, helper_ms)
    return finish + CALL_OVERHEAD_MS
