"""Per-head RMSNorm + partial split-half RoPE, in place, as H3 applies it on the qkv buffer.

Upstream H3 calls comfy-kitchen's `rms_rope_split_half_(q, k, table, qw, kw, epsilon, rot_dim)`
on `[1, S, H, D]` views of the qkv projection output. The twin does the same when comfy-kitchen
is importable and takes the dtype (fp16/bf16/fp32), and otherwise uses the PyTorch reference below
(same maths: RMSNorm over the whole head dim, then pair i rotates elements [i] and
[i + rot_dim/2] of the first rot_dim elements; fp64 twins, used as error references, stay fp64).
"""

from __future__ import annotations

import math

import torch

try:  # comfy-kitchen is a runtime dependency; the reference keeps the twin usable without it
    import comfy_kitchen as _ck
except ImportError:  # pragma: no cover - exercised only where comfy-kitchen is missing
    _ck = None


KITCHEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # others: the reference


def rope_rotation_table(angles_SR: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, rot_dim] pair angles (duplicated halves) -> [1, S, 1, rot_dim/2, 2, 2] rotations."""
    half = angles_SR.shape[-1] // 2
    ang = angles_SR[:, :half]
    c, s = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, angles_SR.shape[0], 1, half, 2, 2)
    return table.to(dtype)


def _rms_rope_reference_(
    x_BSHD: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float, rot_dim: int
) -> None:
    work = torch.promote_types(x_BSHD.dtype, torch.float32)  # fp64 stays fp64
    xf = x_BSHD.to(work)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)
    half = rot_dim // 2
    a, b = xf[..., :half], xf[..., half:rot_dim]
    t = table.to(work)  # [1, S, 1, half, 2, 2]
    ra = t[..., 0, 0] * a + t[..., 0, 1] * b
    rb = t[..., 1, 0] * a + t[..., 1, 1] * b
    xf = torch.cat([ra, rb, xf[..., rot_dim:]], dim=-1)
    x_BSHD.copy_(xf.to(x_BSHD.dtype))


def rms_rope_split_half_(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    table: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    rot_dim: int,
) -> None:
    """In place on q and k (views into the qkv buffer)."""
    if _ck is not None and q_BSHD.dtype in KITCHEN_DTYPES:
        _ck.rms_rope_split_half_(q_BSHD, k_BSHD, table, q_weight, k_weight, epsilon=eps,
                                 rot_dim=rot_dim)
        return
    _rms_rope_reference_(q_BSHD, table, q_weight, eps, rot_dim)
    _rms_rope_reference_(k_BSHD, table, k_weight, eps, rot_dim)


def axis_inverse_frequencies(freqs_per_axis: int) -> torch.Tensor:
    return torch.exp(-math.log(10000.0) * torch.arange(freqs_per_axis, dtype=torch.float32)
                     / freqs_per_axis)
