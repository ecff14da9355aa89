"""The functions an H3 block's own module calls, found at call time from that module.

Kept for the old sequence runner (`legacy_sequence_runner`, timing only): chunking wraps
upstream's modules instead and the sequence runner runs upstream's block.

The chunked block forward must run the very kernels the unpatched block runs, so the result is
bit-identical and every other hook still applies: the attention entry point the H3 module
imported by name (`optimized_attention`, where attention overrides such as Dual-Sage are
honoured), its tensor container, the in-place q/k RMSNorm + RoPE, the modulation helpers. The
twin (`twin.model`) and ComfyUI's `comfy.ldm.minimax.model` expose them under
slightly different names; both are looked up on each call, as the module itself does, so a
function rebound later (a training bridge, a profiler) is still the one used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..chunking.sizing import row_chunks
from ..chunking.wrappers import project_rows as _project


class H3Ops:
    """Call-time view of the functions of the module that defines an H3 `DiTBlock`."""

    def __init__(self, module: ModuleType):
        self.module = module
        comfy = getattr(module, "comfy", None)
        self.is_comfyui = comfy is not None and hasattr(comfy, "quant_ops")

    @classmethod
    def for_block(cls, block: torch.nn.Module) -> H3Ops:
        return cls(sys.modules[type(block).__module__])

    # ------------------------------------------------------------------ attention
    @property
    def optimized_attention(self) -> Callable[..., torch.Tensor]:
        return self.module.optimized_attention

    def wrap(self, tensor: torch.Tensor) -> Any:
        """An `AttentionTensorContainer` when this ComfyUI era has one, else the tensor."""
        container = getattr(self.module, "AttentionTensorContainer", None)
        return tensor if container is None else container(tensor)

    def in_training(self) -> bool:
        if not self.is_comfyui:
            return False
        return bool(getattr(self.module.comfy.model_management, "in_training", False))

    def norm_weight(self, weight: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.is_comfyui:
            return self.module.comfy.model_management.cast_to(weight, device=device)
        return weight.to(device)

    def rms_rope_(self, q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, table: torch.Tensor,
                  q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  rot_dim: int) -> None:
        """Per-head RMSNorm + split-half RoPE in place on q/k views of the qkv buffer."""
        if self.is_comfyui:
            self.module.comfy.quant_ops.ck.rms_rope_split_half_(
                q_BSHD, k_BSHD, table, q_weight, k_weight, epsilon=eps, rot_dim=rot_dim)
        else:
            self.module.rms_rope_split_half_(q_BSHD, k_BSHD, table, q_weight, k_weight, eps,
                                             rot_dim)

    # ------------------------------------------------------------------ modulation
    def mod_scale_shift(self, h: torch.Tensor, shift, scale, segments) -> torch.Tensor:
        fn = getattr(self.module, "_mod_scale_shift", None) or self.module.mod_scale_shift
        return fn(h, shift, scale, segments)

    def mod_gate(self, x: torch.Tensor, gate, other: torch.Tensor, segments) -> torch.Tensor:
        fn = getattr(self.module, "_mod_gate", None) or self.module.mod_gate
        return fn(x, gate, other, segments)


def project_rows(linear: torch.nn.Module, x_SK: torch.Tensor, chunk: int,
                 floor: int | None = None) -> torch.Tensor:
    """linear(x) as [S, N], `chunk` rows at a time (`chunking.wrappers.project_rows`)."""
    return _project(linear, x_SK, row_chunks(x_SK.shape[0], chunk, floor))
