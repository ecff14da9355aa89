"""This pack's own Sage-style attention in Triton: INT8 Q*K^T, fp16 (or fp8) P*V.

Public face of backend `triton_sage` (the registry in `backends.py` imports this file lazily):
`triton_sage_attention`, `is_available`, `CONSTRAINTS`. This file imports without Triton; the
kernels live in `triton_sage_kernels.py` and load on first use.

Three launches per call:
1. statistics: K's fp32 sum per chunk of tokens (and |V|'s channel max for fp8 P*V);
2. quantization: Q * (scale * log2 e) and K - mean(K) to INT8 with one fp32 scale per token,
   V to fp16 (or fp8 with a per-channel scale), all into new contiguous
   buffers (the caller's q, k, v are only read: subtracting K's mean changes no softmax row,
   because it shifts every score of a query by the same amount);
3. attention: INT8 tensor-core Q*K^T with INT32 accumulation, online softmax in fp32 with exp2,
   P*V in fp16 (or fp8 e4m3) with fp32 accumulation; the last key block masks its pad keys.

Legend: B batch, H heads, S tokens, D head dim; `_BHSD` names a tensor by its dims.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from types import ModuleType
from typing import Any

import torch

PV_DTYPES = ("fp16", "fp8")
HEAD_DIMS = (64, 128)
# used where autotuning cannot run (Triton's CPU interpreter) and by explicit-config callers
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4,
                                  "num_stages": 3}

CONSTRAINTS: dict[str, Any] = {
    "dtypes": ("float16", "bfloat16"),
    "head_dims": HEAD_DIMS,
    "layout": "q, k, v [B, H, S, D] with any strides (H3's strided views of its qkv buffer are "
              "read in place); out [B, H, S, D], a view of a contiguous [B, S, H, D] buffer",
    "seq_q_equals_seq_k": True,
    "causal": False,
    "attn_mask": False,
    "min_compute_capability": (8, 0),  # NVIDIA: INT8 tensor cores through Triton
    "fp8_min_compute_capability": (8, 9),  # NVIDIA: fp8 e4m3 matrix unit (pv_dtype="fp8")
    "rocm": "by design (no PTX, no tensor descriptors); not yet run on AMD hardware",
    "max_tokens": "no 32-bit limit: row offsets are 64-bit (S = 102,107 with a 21,504 row "
                  "stride tested)",
    "notes": "INT8 per-token quantization of Q and of K minus its token mean; relative L2 "
             "error vs fp32 attention ~0.9% with fp16 P*V, ~3.8% with fp8 (random H3-shaped "
             "inputs, H200); inputs are never written; deterministic (no atomics)",
}

_kernels: ModuleType | None = None


def _load_kernels() -> ModuleType:
    global _kernels
    if _kernels is None:
        _kernels = importlib.import_module(".triton_sage_kernels", __package__)
    return _kernels


def _triton_error() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return (f"triton not importable ({exc!r}); pip install triton "
                "(Windows: pip install triton-windows)")
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rocm_arch(device: torch.device) -> str:
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def fp8_supported(device: torch.device) -> bool:
    """True where the GPU has an fp8 e4m3 (OCP) matrix unit Triton can target."""
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        arch = _rocm_arch(device)
        return arch.startswith("gfx12") or arch == "gfx950"
    return torch.cuda.get_device_capability(device) >= CONSTRAINTS["fp8_min_compute_capability"]


DYNAMIC_VRAM_REFUSAL = (
    "triton_sage is refused while ComfyUI's DynamicVRAM (comfy-aimdo) is on: a process running "
    "it there crashed (segfault) on NVIDIA and the crash is not yet explained, and the kernel is "
    "at most 1.06x PyTorch's SDPA; use the 'comfyui' attention (ComfyUI's own, exact), or start "
    "ComfyUI with --disable-dynamic-vram to use triton_sage")


def dynamic_vram_refusal() -> str | None:
    """The refusal while ComfyUI runs DynamicVRAM, else None.

    A GPU test session under comfy-aimdo crashed (segfault, no Python error to catch) while
    this kernel's tests ran. Later runs put the crash in `torch.cuda.empty_cache` after a long
    session, with this kernel refused, and the kernel ran under comfy-aimdo in a process of its
    own (tests/triton_dynamic_case.py); until the crash is explained the kernel stays off
    there: a refusal costs the user 6% at most, a crash costs their ComfyUI session."""
    from ..comfy_seam.memory import dynamic_vram_enabled

    return DYNAMIC_VRAM_REFUSAL if dynamic_vram_enabled() else None


def is_available(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the kernel can run on `device` (default: the current GPU), and why (not)."""
    error = _triton_error() or dynamic_vram_refusal()
    if error is not None:
        return False, error
    if not torch.cuda.is_available():
        return False, "no CUDA/ROCm GPU visible to PyTorch"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA/ROCm GPU"
    if torch.version.hip is not None:
        arch = _rocm_arch(device)
        # CDNA (gfx9) has INT8 MFMA, RDNA3/4 (gfx11/gfx12) INT8 WMMA; older RDNA has neither
        if arch.startswith(("gfx9", "gfx11", "gfx12")):
            return True, f"ROCm {arch}: supported by design, not yet validated on AMD hardware"
        return False, f"ROCm {arch}: no INT8 matrix unit (needs CDNA, RDNA3 or RDNA4)"
    cc = torch.cuda.get_device_capability(device)
    need = CONSTRAINTS["min_compute_capability"]
    if cc < need:
        return False, f"compute capability {cc[0]}.{cc[1]} below {need[0]}.{need[1]}"
    return True, f"compute capability {cc[0]}.{cc[1]}"


def _check(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
           pv_dtype: str) -> None:
    if pv_dtype not in PV_DTYPES:
        raise ValueError(f"pv_dtype={pv_dtype!r}; use one of {PV_DTYPES}")
    if not (q_BHSD.dim() == k_BHSD.dim() == v_BHSD.dim() == 4):
        raise ValueError(f"q, k, v must be [B, H, S, D]; got {tuple(q_BHSD.shape)}, "
                         f"{tuple(k_BHSD.shape)}, {tuple(v_BHSD.shape)}")
    if not (q_BHSD.shape == k_BHSD.shape == v_BHSD.shape):
        raise ValueError(f"q, k, v shapes differ ({tuple(q_BHSD.shape)}, {tuple(k_BHSD.shape)}, "
                         f"{tuple(v_BHSD.shape)}); triton_sage is self-attention only")
    if q_BHSD.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q_BHSD.shape[-1]} not supported; use one of {HEAD_DIMS}")
    if not (q_BHSD.dtype == k_BHSD.dtype == v_BHSD.dtype) or \
            q_BHSD.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtypes {q_BHSD.dtype}, {k_BHSD.dtype}, {v_BHSD.dtype}: "
                         "q, k, v must all be float16 or all bfloat16")
    if not (q_BHSD.device == k_BHSD.device == v_BHSD.device):
        raise ValueError(f"q, k, v on {q_BHSD.device}, {k_BHSD.device}, {v_BHSD.device}: "
                         "move them to one device")
    if q_BHSD.shape[2] == 0:
        raise ValueError("S = 0: nothing to attend")
    if pv_dtype == "fp8" and q_BHSD.device.type == "cuda" and not fp8_supported(q_BHSD.device):
        raise ValueError(f"pv_dtype='fp8' needs an fp8 matrix unit, which {q_BHSD.device} "
                         "lacks; use pv_dtype='fp16'")


def triton_sage_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                          scale: float | None = None, pv_dtype: str = "fp16") -> torch.Tensor:
    """q, k, v `[B, H, S, D]` (any strides; fp16 or bf16; D 64 or 128) -> out `[B, H, S, D]`.

    Non-causal softmax(q k^T * scale) v, with scale defaulting to D**-0.5. The output has q's
    dtype and is a `[B, H, S, D]` view of a contiguous `[B, S, H, D]` buffer, so
    `out.transpose(1, 2).reshape(B, S, H * D)` (ComfyUI's layout) copies nothing. Runs on the
    inputs' device whatever the current device is; never writes q, k or v.
    pv_dtype: "fp16" (default) or "fp8" (e4m3, NVIDIA compute capability 8.9+).
    """
    return attention_with_config(q_BHSD, k_BHSD, v_BHSD, scale=scale, pv_dtype=pv_dtype)


def attention_with_config(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                          scale: float | None = None, pv_dtype: str = "fp16",
                          config: dict[str, int] | None = None,
                          profile: dict[str, Any] | None = None) -> torch.Tensor:
    """`triton_sage_attention` with the tile choices exposed, for benchmarks and tests.

    q, k, v `[B, H, S, D]` -> out `[B, H, S, D]`. config: like `DEFAULT_CONFIG` (BLOCK_M and
    BLOCK_N in 64, 128; num_warps; num_stages) for one fixed compile, or None to autotune (per
    power of two of S). profile: a dict that receives
    the compiled attention kernel under "attn" (for its registers, spills and assembly).
    """
    refusal = dynamic_vram_refusal()
    if refusal is not None:  # before any launch: see dynamic_vram_refusal
        raise RuntimeError(refusal)
    _check(q_BHSD, k_BHSD, v_BHSD, pv_dtype)
    if config is not None:
        config = dict(DEFAULT_CONFIG, **config)
        if not {config["BLOCK_M"], config["BLOCK_N"]} <= {64, 128}:
            raise ValueError(f"config {config}: BLOCK_M and BLOCK_N must be 64 or 128")
    kern = _load_kernels()
    device = q_BHSD.device
    launch_ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with launch_ctx:
        return _run(kern, q_BHSD, k_BHSD, v_BHSD, scale, pv_dtype == "fp8", config, profile)


def _run(kern: ModuleType, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
         scale: float | None, pv_fp8: bool, config: dict[str, int] | None,
         profile: dict[str, Any] | None) -> torch.Tensor:
    b, h, s, d = q_BHSD.shape
    bh = b * h
    device = q_BHSD.device
    pad = kern.PAD_TOKENS
    sp = -(-s // pad) * pad
    sm_scale = d ** -0.5 if scale is None else float(scale)
    f32 = torch.float32

    # 1. statistics: K's mean over tokens (and |V|'s channel max for fp8), per (batch, head)
    n_chunks = -(-s // kern.STATS_CHUNK)
    ksum = torch.empty(bh, n_chunks, d, device=device, dtype=f32)
    vmax = torch.empty(bh, n_chunks, d, device=device, dtype=f32) if pv_fp8 else ksum
    kern._stats_kernel[(n_chunks, bh)](
        k_BHSD, v_BHSD, ksum, vmax, s, h, *k_BHSD.stride(), *v_BHSD.stride(), n_chunks,
        HEAD_DIM=d, CHUNK=kern.STATS_CHUNK, TILE=64, V_ABSMAX=pv_fp8, num_warps=4)
    kmean_HD = ksum.sum(dim=1) / s
    if pv_fp8:
        vmax_HD = vmax.amax(dim=1)
        # an all-zero channel keeps scale 1 so the quantizer never divides by zero
        vs_HD = torch.where(vmax_HD > 0, vmax_HD / kern.FP8_E4M3_MAX, torch.ones_like(vmax_HD))
    else:
        vs_HD = kmean_HD  # unused placeholder pointer

    # 2. quantization into contiguous, zero-padded buffers (the inputs are only read)
    q8 = torch.empty(bh, sp, d, device=device, dtype=torch.int8)
    k8 = torch.empty(bh, sp, d, device=device, dtype=torch.int8)
    if pv_fp8:
        vq = torch.empty(bh, d, sp, device=device, dtype=torch.float8_e4m3fn)
    else:
        vq = torch.empty(bh, sp, d, device=device, dtype=torch.float16)
    qs = torch.empty(bh, sp, device=device, dtype=f32)
    ks = torch.empty(bh, sp, device=device, dtype=f32)
    kern._quant_kernel[(sp // pad, bh)](
        q_BHSD, k_BHSD, v_BHSD, kmean_HD, vs_HD, q8, k8, vq, qs, ks,
        s, sp, sm_scale * math.log2(math.e), h,
        *q_BHSD.stride(), *k_BHSD.stride(), *v_BHSD.stride(),
        HEAD_DIM=d, BLOCK_Q=pad, PV_FP8=pv_fp8, num_warps=8)

    # 3. attention
    out_BSHD = torch.empty(b, s, h, d, device=device, dtype=q_BHSD.dtype)
    args = (q8, k8, vq, qs, ks, vs_HD, out_BSHD, h, out_BSHD.stride(0), out_BSHD.stride(2),
            out_BSHD.stride(1), s, sp, kern.tuning_bucket(s))
    meta = dict(HEAD_DIM=d, PV_FP8=pv_fp8)
    if _interpreting() or device.type != "cuda":
        # Triton's CPU interpreter cannot autotune
        config = dict(config or DEFAULT_CONFIG)
    if config is None:
        def grid(tile: dict[str, Any]) -> tuple[int, int]:
            return (-(-s // tile["BLOCK_M"]), bh)

        compiled = kern.attn_kernel_tuned[grid](*args, **meta)
    else:
        compiled = kern._attn_kernel[(-(-s // config["BLOCK_M"]), bh)](
            *args, **meta, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
            num_warps=config["num_warps"], num_stages=config["num_stages"])
    if profile is not None:
        profile["attn"] = compiled
    return out_BSHD.transpose(1, 2)


__all__ = ["CONSTRAINTS", "DYNAMIC_VRAM_REFUSAL", "attention_with_config", "dynamic_vram_refusal",
           "fp8_supported", "is_available", "triton_sage_attention"]


def reference_attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             chunk: int = 8192) -> torch.Tensor:
    """fp32 attention `[B, H, S, D] -> [B, H, S, D]`, queries in chunks (no S x S matrix held).

    The accuracy reference of this kernel's tests and benchmark.
    """
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    kf, vf = k.float(), v.float()
    for start in range(0, q.shape[2], chunk):
        out[:, :, start:start + chunk] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:start + chunk].float(), kf, vf)
    return out
