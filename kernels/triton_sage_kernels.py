"""Triton kernels behind `triton_sage.py`: statistics, quantization, INT8 attention.

Imported only when Triton is importable (`triton_sage.py` guards it), so this file may import
Triton at the top. Written for NVIDIA and ROCm Triton alike: no inline assembly, no tensor
descriptors, no vendor library calls.

Legend: H heads (batch x heads), S tokens, SP tokens padded to a multiple of `PAD_TOKENS` (128),
D head dim, C chunks of `STATS_CHUNK` tokens. Buffers made here are contiguous:
  q8_HSPD, k8_HSPD  int8 Q and K, one scale per token (K after its mean was subtracted)
  qs_HSP, ks_HSP    fp32 per-token scales
  v16_HSPD          fp16 V (pv "fp16")     or  v8_HDSP  fp8 e4m3 V, transposed (pv "fp8"),
  vs_HD             fp32 per-channel V scale (fp8 only)
Pad rows (S..SP) of every quantized buffer are written as zeros, so the attention kernel loads
whole tiles without masks and only masks scores in its last key block.

Offsets: a strided view of H3's qkv buffer has a row stride of 21,504 elements, so
102,107 rows span 2.2e9 elements, past 2^31: every row index is cast to int64 before it
multiplies a stride.
"""

from __future__ import annotations

import triton
import triton.language as tl

PAD_TOKENS = 128  # quantized buffers are padded to this; BLOCK_M and BLOCK_N divide it
STATS_CHUNK = 1024  # tokens per partial sum in the K-mean pass
FP8_E4M3_MAX = 448.0  # e4m3's largest finite value, for the host side
FP8_MAX = tl.constexpr(FP8_E4M3_MAX)  # the same, for the kernels


# do_not_specialize: S and counts derived from it vary per call; specializing them (== 1,
# divisible by 16) would compile a new kernel for many lengths
@triton.jit(do_not_specialize=["S", "n_chunks"])
def _stats_kernel(K, V, ksum_HCD, vmax_HCD, S, n_heads,
                  stride_kb, stride_kh, stride_ks, stride_kd,
                  stride_vb, stride_vh, stride_vs, stride_vd,
                  n_chunks, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                  V_ABSMAX: tl.constexpr):
    """Per chunk of tokens: the fp32 sum of K (for its mean) and, for fp8 V, |V|'s maximum.

    Partial results per chunk, summed on the host side of the launch by torch, keep the
    mean deterministic (no atomics: the registry promises bit-identical reruns).
    """
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # batch * n_heads + head
    k_base = K + (head // n_heads) * stride_kb + (head % n_heads) * stride_kh
    v_base = V + (head // n_heads) * stride_vb + (head % n_heads) * stride_vh
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    vmax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for t in range(0, CHUNK, TILE):
        rows = chunk * CHUNK + t + tl.arange(0, TILE)
        mask = rows[:, None] < S
        rows64 = rows.to(tl.int64)
        k = tl.load(k_base + rows64[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=mask, other=0.0)
        acc += tl.sum(k.to(tl.float32), axis=0)
        if V_ABSMAX:
            v = tl.load(v_base + rows64[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=mask, other=0.0)
            vmax = tl.maximum(vmax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
    out = (head * n_chunks + chunk) * HEAD_DIM + offs_d
    tl.store(ksum_HCD + out, acc)
    if V_ABSMAX:
        tl.store(vmax_HCD + out, vmax)


@triton.jit
def _round_to_int8(x):
    # round half away from zero; a plain .to(int8) would truncate toward zero
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)


@triton.jit(do_not_specialize=["S", "q_mult"])
def _quant_kernel(Q, K, V, kmean_HD, vs_HD, q8, k8, vq, qs, ks,
                  S, SP, q_mult, n_heads,
                  stride_qb, stride_qh, stride_qs, stride_qd,
                  stride_kb, stride_kh, stride_ks, stride_kd,
                  stride_vb, stride_vh, stride_vs, stride_vd,
                  HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, PV_FP8: tl.constexpr):
    """BLOCK_Q tokens of one head: Q and K - mean(K) to INT8, one scale per token; V to fp16/fp8.

    Per-token scales: one large-norm token then coarsens only its own row, never the 63 or
    127 others a per-block scale would share it with. q_mult = softmax scale * log2(e), folded
    into Q's scales so scores come out in base 2 for exp2.
    """
    blk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # batch * n_heads + head
    q_base = Q + (head // n_heads) * stride_qb + (head % n_heads) * stride_qh
    k_base = K + (head // n_heads) * stride_kb + (head % n_heads) * stride_kh
    v_base = V + (head // n_heads) * stride_vb + (head % n_heads) * stride_vh
    offs_d = tl.arange(0, HEAD_DIM)
    rows = blk * BLOCK_Q + tl.arange(0, BLOCK_Q)
    valid = rows[:, None] < S
    rows64 = rows.to(tl.int64)
    out_offs = head * SP * HEAD_DIM + rows64[:, None] * HEAD_DIM + offs_d[None, :]
    scale_offs = head * SP + rows64

    q = tl.load(q_base + rows64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=valid, other=0.0).to(tl.float32) * q_mult
    # floor on the range: an all-zero token gets a tiny nonzero scale, so -inf * scale in the
    # attention kernel's tail mask never becomes NaN
    q_amax = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-20)
    tl.store(q8 + out_offs, _round_to_int8(q * (127.0 / q_amax)[:, None]))
    tl.store(qs + scale_offs, q_amax / 127.0)

    kmean = tl.load(kmean_HD + head * HEAD_DIM + offs_d)
    k = tl.load(k_base + rows64[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=valid, other=0.0).to(tl.float32)
    # pad rows stay exactly zero after the shift (their scores are masked anyway)
    k = tl.where(valid, k - kmean[None, :], 0.0)
    k_amax = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-20)
    tl.store(k8 + out_offs, _round_to_int8(k * (127.0 / k_amax)[:, None]))
    tl.store(ks + scale_offs, k_amax / 127.0)

    v = tl.load(v_base + rows64[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                mask=valid, other=0.0).to(tl.float32)
    if PV_FP8:
        v_inv = 1.0 / tl.load(vs_HD + head * HEAD_DIM + offs_d)
        v8 = (v * v_inv[None, :]).to(tl.float8e4nv)
        # transposed [D, SP]: the fp8 matrix unit wants V's reduction dim (tokens) contiguous
        t_offs = head * SP * HEAD_DIM + offs_d[None, :].to(tl.int64) * SP + rows64[:, None]
        tl.store(vq + t_offs, v8)
    else:
        tl.store(vq + out_offs, v.to(tl.float16))


@triton.jit
def _softmax_pv(acc, l_i, mu_i, qk, ks, qs_row, v_ptrs, kv_left,
                BLOCK_N: tl.constexpr, MASK_TAIL: tl.constexpr, PV_FP8: tl.constexpr):
    """Online softmax of one key block's INT32 scores (fp32, base 2), then P*V (fp32 sums).

    Scores are qs_i * u_ij with u_ij = ks_j * (q8_i . k8_j); mu_i is the running max of u over
    keys, so every exponent is one multiply-add: exp2(qs_i * u_ij - qs_i * mu_i).
    """
    # ptxas turns this conversion into I2FP on sm_90, not the slow I2F: a bit trick (add the
    # bits of 1.5 * 2^23 as integers) measured slower, 72.7 ms against 68.6 (notes)
    u = qk.to(tl.float32) * ks[None, :]
    if MASK_TAIL:
        u = tl.where(tl.arange(0, BLOCK_N)[None, :] < kv_left, u, float("-inf"))
    mu_new = tl.maximum(mu_i, tl.max(u, axis=1))
    p = tl.math.exp2(u * qs_row[:, None] - (mu_new * qs_row)[:, None])
    alpha = tl.math.exp2((mu_i - mu_new) * qs_row)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if PV_FP8:
        vt = tl.load(v_ptrs)
        # weights scaled to e4m3's top (p <= 1); a fresh fp8 product per block, added in fp32:
        # the fp8 unit's own accumulator is narrower than fp32
        acc = acc + tl.dot((p * FP8_MAX).to(tl.float8e4nv), tl.trans(vt), out_dtype=tl.float32)
    else:
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(tl.float16), v, acc, out_dtype=tl.float32)
    return acc, l_i, mu_new


@triton.jit(do_not_specialize=["S", "s_bucket"])
def _attn_kernel(q8, k8, vq, qs, ks, vs_HD, Out, n_heads, stride_ob, stride_oh, stride_os,
                 S, SP, s_bucket,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PV_FP8: tl.constexpr):
    """One BLOCK_M tile of queries of one head against all S keys (non-causal, no mask)."""
    start_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = head * SP * HEAD_DIM

    q = tl.load(q8 + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    qs_row = tl.load(qs + head * SP + offs_m)
    k_ptrs = k8 + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    ks_ptrs = ks + head * SP + offs_n
    if PV_FP8:
        v_ptrs = vq + base + offs_d[:, None] * SP + offs_n[None, :]
        v_step = BLOCK_N
    else:
        v_ptrs = vq + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        v_step = BLOCK_N * HEAD_DIM

    mu_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = S // BLOCK_N
    for _ in range(0, n_full):
        qk = tl.dot(q, tl.trans(tl.load(k_ptrs)), out_dtype=tl.int32)
        acc, l_i, mu_i = _softmax_pv(acc, l_i, mu_i, qk, tl.load(ks_ptrs), qs_row, v_ptrs,
                                     BLOCK_N, BLOCK_N, False, PV_FP8)
        k_ptrs += BLOCK_N * HEAD_DIM
        ks_ptrs += BLOCK_N
        v_ptrs += v_step
    if n_full * BLOCK_N < S:
        # the only block with pad keys: their scores become -inf, so they weigh nothing
        # (a run-time branch, so one compile serves every S)
        qk = tl.dot(q, tl.trans(tl.load(k_ptrs)), out_dtype=tl.int32)
        acc, l_i, mu_i = _softmax_pv(acc, l_i, mu_i, qk, tl.load(ks_ptrs), qs_row, v_ptrs,
                                     S - n_full * BLOCK_N, BLOCK_N, True, PV_FP8)

    if PV_FP8:
        v_scale = tl.load(vs_HD + head * HEAD_DIM + offs_d)
        out = acc * (v_scale[None, :] / FP8_MAX) / l_i[:, None]
    else:
        out = acc / l_i[:, None]
    rows64 = offs_m.to(tl.int64)
    o_ptrs = (Out + (head // n_heads) * stride_ob + (head % n_heads) * stride_oh
              + rows64[:, None] * stride_os + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < S)


# Autotune: few configs, because each one compiles and each is timed at every new S bucket.
# Measured on an H200 at S = 35,305 (docs/triton_sage_notes.md): one warpgroup on 128 rows
# (4 warps) lets two programs share an SM and was fastest for fp16 P*V; 8 warps on 128 x 128
# tiles was fastest for fp8; 8 warps on 128 x 64 is the one that spills nothing at all.
ATTN_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
]


def tuning_bucket(s: int) -> int:
    # retune per power of two of S, not per exact S (H3's S changes with every canvas)
    return 1 << max(0, (int(s) - 1).bit_length())


# `s_bucket` (an unused kernel argument) is the tuning key for S
attn_kernel_tuned = triton.autotune(
    configs=ATTN_CONFIGS, key=["s_bucket", "HEAD_DIM", "PV_FP8"],
)(_attn_kernel)
