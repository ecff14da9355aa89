"""The attention backends: each registers itself, or records why it cannot.

- `sdpa`: PyTorch scaled_dot_product_attention, always available, the reference.
- `ck_int8`: comfy-kitchen `int8_attention` (INT8 Q/K/V), CUDA/HIP when its kernel supports the
  GPU (`comfy_kitchen.int8_attention_is_available(device)`).
- `sageattention`: the PyPI `sageattention` package (1.0.6 Triton kernels). Its known limits are
  declared as constraints instead of being discovered as wrong pictures: it counts padding keys in
  the softmax unless S is a multiple of 64, its 32-bit offsets overflow once S x row stride
  reaches 2^31 (H3 at 102k tokens), and it subtracts K's mean in place, so it gets a copy of k.
- `flash`: `flash_attn.flash_attn_func` when the package imports.
- `triton_sage`: this pack's Triton kernel (`kernels/triton_sage.py`), imported lazily.

Legend: B batch, H heads, S sequence, D head dim.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .constraints import ALL_FLOAT_TYPES, FLOAT16_TYPES, AttentionCall, Constraints, ShapeRule
from .registry import AttentionBackend, mark_unavailable, register

INT32_LIMIT = 2**31


def _sdpa(q_BHSD, k_BHSD, v_BHSD, *, scale=None):
    return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, dropout_p=0.0,
                                          is_causal=False, scale=scale)


def _register_sdpa() -> None:
    register(AttentionBackend(
        name="sdpa", fn=_sdpa, deterministic=True,
        description="PyTorch scaled_dot_product_attention (reference)",
        constraints=Constraints(dtypes=ALL_FLOAT_TYPES, device_types=frozenset({"cuda", "cpu"}))))


def _register_ck_int8() -> None:
    try:
        import comfy_kitchen as ck
    except ImportError as exc:
        mark_unavailable("ck_int8", f"comfy-kitchen not importable ({exc}); "
                                    "pip install comfy-kitchen")
        return
    if not hasattr(ck, "int8_attention"):
        mark_unavailable("ck_int8", "this comfy-kitchen has no int8_attention; "
                                    "pip install -U comfy-kitchen")
        return

    def device_check(device: torch.device) -> tuple[bool, str]:
        if ck.int8_attention_is_available(device):
            return True, ""
        return False, f"comfy-kitchen int8_attention does not support {device}"

    def run(q_BHSD, k_BHSD, v_BHSD, *, scale=None):
        return ck.int8_attention(q_BHSD, k_BHSD, v_BHSD, scale=scale)

    register(AttentionBackend(
        name="ck_int8", fn=run, deterministic=True, quantizing=True, device_check=device_check,
        description="comfy-kitchen int8_attention (INT8 Q/K/V, ~1.7% error)",
        constraints=Constraints(dtypes=FLOAT16_TYPES, device_types=frozenset({"cuda"}))))


SAGE_SEQ_MULTIPLE = 64
SAGEATTENTION_RULES = (
    ShapeRule(f"sageattention counts padding keys in the softmax: sequence length must be a "
              f"multiple of {SAGE_SEQ_MULTIPLE}",
              lambda c: c.seq_q % SAGE_SEQ_MULTIPLE == 0 and c.seq_k % SAGE_SEQ_MULTIPLE == 0),
    ShapeRule("sageattention uses 32-bit offsets: sequence length x row stride must stay "
              "below 2^31 elements",
              lambda c: max(c.seq_q, c.seq_k) * c.max_row_stride < INT32_LIMIT),
    ShapeRule("sageattention supports head dim 64, 96 or 128",
              lambda c: c.head_dim in (64, 96, 128)),
)


def _register_sageattention() -> None:
    try:
        sage = importlib.import_module("sageattention")
    except Exception as exc:  # any import failure (missing triton, bad build) means unavailable
        mark_unavailable("sageattention", f"sageattention not importable ({exc!r}); "
                                          "pip install sageattention")
        return

    def run(q_BHSD, k_BHSD, v_BHSD, *, scale=None):
        # sageattention subtracts K's mean in place: hand it a private copy, never the caller's
        k_private = k_BHSD.clone(memory_format=torch.contiguous_format)
        return sage.sageattn(q_BHSD, k_private, v_BHSD, tensor_layout="HND", is_causal=False,
                             sm_scale=scale)

    register(AttentionBackend(
        name="sageattention", fn=run, deterministic=True, quantizing=True,
        description="sageattention (PyPI, INT8 QK); slower than SDPA on Hopper",
        constraints=Constraints(dtypes=FLOAT16_TYPES, device_types=frozenset({"cuda"}),
                                min_compute_capability=(8, 0),
                                shape_rules=SAGEATTENTION_RULES)))


def _register_flash() -> None:
    try:
        flash_attn = importlib.import_module("flash_attn")
    except Exception as exc:
        mark_unavailable("flash", f"flash_attn not importable ({exc!r}); pip install flash-attn")
        return

    def run(q_BHSD, k_BHSD, v_BHSD, *, scale=None):
        out_BSHD = flash_attn.flash_attn_func(q_BHSD.transpose(1, 2), k_BHSD.transpose(1, 2),
                                              v_BHSD.transpose(1, 2), softmax_scale=scale)
        return out_BSHD.transpose(1, 2)

    register(AttentionBackend(
        name="flash", fn=run, deterministic=True, description="flash-attn flash_attn_func",
        constraints=Constraints(
            dtypes=FLOAT16_TYPES, device_types=frozenset({"cuda"}),
            min_compute_capability=(8, 0),
            shape_rules=(ShapeRule("flash-attn needs head dim <= 256 and a multiple of 8",
                                   lambda c: c.head_dim <= 256 and c.head_dim % 8 == 0),))))


def _register_triton_sage() -> None:
    try:
        module = importlib.import_module(".triton_sage", __package__)
        kernel = module.triton_sage_attention
        is_available = module.is_available
    except Exception as exc:
        mark_unavailable("triton_sage", f"kernels/triton_sage.py not usable ({exc!r})")
        return

    def run(q_BHSD, k_BHSD, v_BHSD, *, scale=None):
        return kernel(q_BHSD, k_BHSD, v_BHSD, scale=scale)

    declared = getattr(module, "CONSTRAINTS", {})
    head_dims = tuple(declared.get("head_dims", (64, 128)))
    register(AttentionBackend(
        name="triton_sage", fn=run, deterministic=True, quantizing=True,
        device_check=lambda device: is_available(device),
        description="this pack's Triton INT8 attention",
        constraints=Constraints(
            dtypes=FLOAT16_TYPES, device_types=frozenset({"cuda"}),
            shape_rules=(
                ShapeRule(f"triton_sage supports head dim {head_dims}",
                          lambda c: c.head_dim in head_dims),
                ShapeRule("triton_sage is self-attention only: q and k need the same length",
                          lambda c: c.seq_q == c.seq_k)))))


def register_all() -> None:
    _register_sdpa()
    _register_ck_int8()
    _register_sageattention()
    _register_flash()
    _register_triton_sage()


__all__ = ["AttentionCall", "SAGEATTENTION_RULES", "register_all"]
