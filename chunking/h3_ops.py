"""The functions an H3 block's own module calls, found at call time from that module.

The chunked block forward must run the very kernels the unpatched block runs, so the result is
bit-identical and every other hook still applies: the attention entry point the H3 module
imported by name (`optimized_attention`, where attention overrides such as Dual-Sage are
honoured), its tensor container, the in-place q/k RMSNorm + RoPE, the modulation helpers. The
twin (`h3_multigpu.twin.model`) and ComfyUI's `comfy.ldm.minimax.model` expose them under
slightly different names; both are looked up on each call, as the module itself does, so a
function rebound later (a training bridge, a profiler) is still the one used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


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

    # ------------------------------------------------------------------ sizing hints
    def mlp_kernel(self, fc2: torch.nn.Module) -> str:
        """Which SwiGLU implementation the block's MLP runs (for `sizing.Kernels.mlp`)."""
        if not self.is_comfyui:
            return "twin"
        return "comfy_int8" if self.fused_int8_fc2(fc2) else "comfy"

    def fused_int8_fc2(self, fc2: torch.nn.Module) -> bool:
        """Whether the block's MLP computes fc2 without calling `fc2.forward`.

        ComfyUI internal: H3's MLP is `comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")`, which
        for an INT8 weight (QuantizedTensor, `TensorWiseINT8Layout`, not transposed, not in
        training) runs comfy-kitchen's fused `int8_linear` itself: an on-activation (bypass)
        adapter wrapped around `fc2.forward` does not run there, unpatched or chunked. Checked
        on ComfyUI 0.33.0 and the newest files."""
        if not self.is_comfyui or self.in_training():
            return False
        if not hasattr(getattr(self.module.comfy, "ops", None), "linear_input_act"):
            return False
        weight = getattr(fc2, "weight", None)
        return (type(weight).__name__ == "QuantizedTensor"
                and getattr(weight, "_layout_cls", None) == "TensorWiseINT8Layout"
                and not getattr(getattr(weight, "_params", None), "transposed", False))


def weight_format(linear: torch.nn.Module) -> str:
    """The format `linear`'s GEMM runs in, from its weight (`exact_rows.FORMAT_RULES`):
    "int8_convrot", "int8", "fp8", "nvfp4" (static input_scale), "nvfp4_dynamic" (none), another
    quantized layout's name, or the plain dtype ("bfloat16", "float16", "float32").

    ComfyUI internals: `comfy.quant_ops.QuantizedTensor` (`_layout_cls`, `_params.convrot`,
    `_params.orig_dtype`), the module's `input_scale` and `weight_function` (checked on
    ComfyUI 0.33.0 and the newest files). A lowvram LoRA (`weight_function`) makes ComfyUI's
    cast dequantize the weight: the GEMM then runs in the original dtype, as a plain one.
    """
    weight = getattr(linear, "weight", None)
    if type(weight).__name__ != "QuantizedTensor":
        return str(getattr(weight, "dtype", "unknown")).removeprefix("torch.")
    params = getattr(weight, "_params", None)
    if getattr(linear, "weight_function", None):
        return str(getattr(params, "orig_dtype", torch.bfloat16)).removeprefix("torch.")
    layout = str(getattr(weight, "_layout_cls", ""))
    if layout == "TensorWiseINT8Layout":
        return "int8_convrot" if getattr(params, "convrot", False) else "int8"
    if "FP8" in layout:
        return "fp8"
    if "NVFP4" in layout:
        return "nvfp4" if getattr(linear, "input_scale", None) is not None else "nvfp4_dynamic"
    return layout or "quantized"


def block_adapter_ranks(block: torch.nn.Module, linears: dict[str, torch.nn.Module]
                        ) -> dict[str, tuple[int, ...]]:
    """The ranks of the on-activation adapters that RUN on each of the block's linears: fc2's
    do not where the MLP's fused INT8 path never calls `fc2.forward` (`fused_int8_fc2`)."""
    ranks = {name: activation_adapter_ranks(module) for name, module in linears.items()}
    if ranks.get("fc2") and H3Ops.for_block(block).fused_int8_fc2(linears["fc2"]):
        ranks["fc2"] = ()
    return ranks


def skipped_adapter_note(block: torch.nn.Module, fc2: torch.nn.Module) -> str:
    """The status note when fc2 carries an on-activation adapter upstream does not run."""
    if activation_adapter_ranks(fc2) and H3Ops.for_block(block).fused_int8_fc2(fc2):
        return ("fc2's on-activation LoRA does not run (upstream's INT8 MLP computes fc2 in "
                "linear_input_act, not fc2.forward): the pack computes what upstream does")
    return ""


def activation_adapters(linear: torch.nn.Module) -> tuple[int, int]:
    """(count, largest rank) of on-activation adapters wrapped around `linear.forward`."""
    ranks = activation_adapter_ranks(linear)
    return len(ranks), max(ranks, default=0)


def activation_adapter_ranks(linear: torch.nn.Module) -> tuple[int, ...]:
    """The rank of each on-activation adapter wrapped around `linear.forward` (0: not a LoRA).

    ComfyUI's bypass injection (and `adapters.attach_activation_lora` for the twin) replaces the
    instance's `forward` with a bound method of a hook object holding `adapter` and
    `original_forward`; stacked injections chain through `original_forward`.
    """
    ranks = []
    forward = linear.__dict__.get("forward")
    while forward is not None:
        hook = getattr(forward, "__self__", None)
        adapter = getattr(hook, "adapter", None)
        if adapter is None or not hasattr(hook, "original_forward"):
            break
        ranks.append(_adapter_rank(adapter))
        forward = hook.original_forward
    return tuple(ranks)


def _adapter_rank(adapter: Any) -> int:
    weights = getattr(adapter, "weights", None)
    if isinstance(weights, (tuple, list)) and len(weights) > 1 and hasattr(weights[1], "shape"):
        return int(weights[1].shape[0])  # LoRA layout: (up [out, r], down [r, in], alpha, ...)
    down = getattr(getattr(adapter, "lora_down", None), "weight", None)
    return int(down.shape[0]) if down is not None else 0
