"""What the pack reads off ComfyUI's H3 model, its weights and its calls: each an internal.

Every function here names the ComfyUI internal it relies on; `internals.INTERNALS` lists them
with the releases they were checked on, and a `comfyui` test resolves each on every bed. The
twin (`twin`) answers the same questions with its own names, so the features run
unchanged on both.
"""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any, NamedTuple

from . import names


def module_of(block: Any) -> ModuleType:
    """The module that defines this H3 block's class (ComfyUI's comfy.ldm.minimax.model or the
    twin's): its module-level names are what the block's own forward calls."""
    return sys.modules[type(block).__module__]


def is_comfyui(block: Any) -> bool:
    comfy = getattr(module_of(block), "comfy", None)
    return comfy is not None and hasattr(comfy, "quant_ops")


def in_training(block: Any) -> bool:
    """ComfyUI internal: `comfy.model_management.in_training`, as the block's own module sees it
    (the H3 module does `import comfy.model_management`; the twin's has no `comfy`: False).
    While it is set H3's Attention takes the out-of-place RoPE and `linear_input_act` the
    unfused path; the sequence split runs inference only."""
    comfy = getattr(module_of(block), "comfy", None)
    return bool(getattr(getattr(comfy, "model_management", None), "in_training", False))


def fused_int8_fc2(block: Any) -> bool:
    """Whether the block's MLP computes fc2 without calling `fc2.forward`.

    ComfyUI internal: H3's MLP is `comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")`, which
    for an INT8 weight (QuantizedTensor, `TensorWiseINT8Layout`, not transposed, not in
    training) runs comfy-kitchen's fused `int8_linear` itself: an on-activation (bypass)
    adapter wrapped around `fc2.forward` does not run there, unpatched or chunked."""
    if not is_comfyui(block) or in_training(block):
        return False
    if not hasattr(getattr(module_of(block).comfy, "ops", None), "linear_input_act"):
        return False
    weight = getattr(block.mlp.fc2, "weight", None)
    return (type(weight).__name__ == "QuantizedTensor"
            and getattr(weight, "_layout_cls", None) == "TensorWiseINT8Layout"
            and not getattr(getattr(weight, "_params", None), "transposed", False))


def mlp_kernel(block: Any) -> str:
    """Which SwiGLU implementation the block's MLP runs (`chunking.sizing.Kernels.mlp`)."""
    if not is_comfyui(block):
        return "twin"
    return "comfy_int8" if fused_int8_fc2(block) else "comfy"


def weight_format(linear: Any) -> str:
    """The format `linear`'s GEMM runs in, from its weight: "int8_convrot", "int8", "fp8",
    "nvfp4" (static input_scale), "nvfp4_dynamic" (none), another quantized layout's name, or
    the plain dtype ("bfloat16", "float16", "float32").

    ComfyUI internals: `comfy.quant_ops.QuantizedTensor` (`_layout_cls`, `_params.convrot`,
    `_params.orig_dtype`), the module's `input_scale` and `weight_function`. A lowvram LoRA
    (`weight_function`) makes ComfyUI's cast dequantize the weight: the GEMM then runs in the
    original dtype, as a plain one.
    """
    weight = getattr(linear, "weight", None)
    if type(weight).__name__ != "QuantizedTensor":
        return str(getattr(weight, "dtype", "unknown")).removeprefix("torch.")
    params = getattr(weight, "_params", None)
    if getattr(linear, "weight_function", None):
        return str(getattr(params, "orig_dtype", "bfloat16")).removeprefix("torch.")
    layout = str(getattr(weight, "_layout_cls", ""))
    if layout == "TensorWiseINT8Layout":
        return "int8_convrot" if getattr(params, "convrot", False) else "int8"
    if "FP8" in layout:
        return "fp8"
    if "NVFP4" in layout:
        return "nvfp4" if getattr(linear, "input_scale", None) is not None else "nvfp4_dynamic"
    return layout or "quantized"


def activation_adapter_ranks(linear: Any) -> tuple[int, ...]:
    """The rank of each on-activation adapter wrapped around `linear.forward` (0: not a LoRA).

    ComfyUI internal: the bypass injection (`comfy.weight_adapter.bypass.BypassForwardHook`)
    replaces the instance's `forward` with a bound method of a hook holding `adapter` and
    `original_forward`; stacked injections chain through `original_forward`. The twin's
    `chunking.adapters.attach_activation_lora` follows the same shape. Forwards the pack wraps
    around them at call time (`chunking.wrappers`) expose `original_forward` too, without an
    adapter, and are looked through.
    """
    ranks = []
    forward = linear.__dict__.get("forward")
    while forward is not None:
        hook = getattr(forward, "__self__", forward)
        if not hasattr(hook, "original_forward"):
            break
        adapter = getattr(hook, "adapter", None)
        if adapter is not None:
            ranks.append(_adapter_rank(adapter))
        forward = hook.original_forward
    return tuple(ranks)


def _adapter_rank(adapter: Any) -> int:
    """ComfyUI internal: a LoRA adapter's `weights` tuple (up [out, r], down [r, in], alpha,
    ...); the twin's adapter has a `lora_down` Linear."""
    weights = getattr(adapter, "weights", None)
    if isinstance(weights, (tuple, list)) and len(weights) > 1 and hasattr(weights[1], "shape"):
        return int(weights[1].shape[0])
    down = getattr(getattr(adapter, "lora_down", None), "weight", None)
    return int(down.shape[0]) if down is not None else 0


def preferred_function(attention_module: Any) -> Any:
    """The attention function this module prefers, or None. ComfyUI internal (newest files):
    `Attention.comfy_attention` (a `ComfyAttention`) and its `function`, passed as
    `preferred_attention=`; `wrap_attn` pops it before it calls an override, so an override that
    means to run what ComfyUI would run reads it here. 0.33.0 has none."""
    return getattr(getattr(attention_module, "comfy_attention", None), "function", None)


def default_attention(block: Any) -> Any:
    """`optimized_attention` as the H3 module imported it (the startup flags' choice). ComfyUI
    internal: `comfy.ldm.minimax.model.optimized_attention` (imported by name: rebinding it in
    attention.py does not reach H3)."""
    return getattr(module_of(block), "optimized_attention", None)


def forward_options(args: tuple, kwargs: dict) -> dict | None:
    """The transformer_options of a DIFFUSION_MODEL wrapper call. ComfyUI internal: the H3
    model's `forward` calls the wrapper executor as `execute(x, timestep, context,
    transformer_options, ...)`, positional at index 3 (0.33.0 and the newest files)."""
    options = kwargs.get(names.TRANSFORMER_OPTIONS)
    if options is None and len(args) > 3 and isinstance(args[3], dict):
        options = args[3]
    return options if isinstance(options, dict) else None


def wrapped_module(executor: Any) -> Any:
    """The module a DIFFUSION_MODEL wrapper runs, or None. ComfyUI internal: the H3 model's
    `forward` builds `WrapperExecutor.new_class_executor(self._forward, self, ...)`, so
    `class_obj` is the diffusion model itself (0.33.0 and the newest files)."""
    return getattr(executor, "class_obj", None)


def sampled_patcher(executor: Any) -> Any:
    """The ModelPatcher an OUTER_SAMPLE wrapper samples with, or None. ComfyUI internal:
    `WrapperExecutor.class_obj` is the CFGGuider, whose `model_patcher` is the model."""
    return getattr(getattr(executor, "class_obj", None), "model_patcher", None)


def quant_algos() -> dict | None:
    """The running ComfyUI's quantization formats (`comfy.quant_ops.QUANT_ALGOS`, 0.33.0 and
    the newest files: name -> {"storage_t": torch dtype, ...}), or None without them."""
    from . import runtime

    return getattr(runtime.quant_ops(), "QUANT_ALGOS", None)


def h3_model_class() -> type | None:
    """`comfy.model_base.MiniMaxH3` (0.33.0 and the newest files), or None on a ComfyUI without
    H3 or outside ComfyUI (the twin in tests)."""
    from . import runtime

    return getattr(runtime.model_base(), "MiniMaxH3", None)


def tensor_bytes(tensor: Any) -> int:
    """Bytes a tensor really holds. A comfy-kitchen `QuantizedTensor` (ComfyUI's INT8 ConvRot
    weights, `ops.mixed_precision_ops`) reports its logical dtype, so `numel * element_size`
    counts an int8 weight at its bf16/fp16 size; its storage is `_qdata` plus the tensors of its
    layout `_params` (the scales). Read on comfy-kitchen 0.2.31 (the 0.33.0 bed) and 0.2.40."""
    import torch

    qdata = getattr(tensor, "_qdata", None)
    params = getattr(tensor, "_params", None)
    if isinstance(qdata, torch.Tensor) and dataclasses.is_dataclass(params):
        extra = (getattr(params, f.name) for f in dataclasses.fields(params))
        return qdata.nbytes + sum(t.nbytes for t in extra if isinstance(t, torch.Tensor))
    return tensor.numel() * tensor.element_size()


# ---- block kernels (planner and run)
# weight_format's names of the layout (TensorWiseINT8Layout) whose fc2 `linear_input_act` runs
# fused with the SwiGLU (`fused_int8_fc2`)
FUSED_FC2_FORMATS = ("int8", "int8_convrot")


class BlockKernels(NamedTuple):
    """The kernels one H3 block's forward runs, in the words of the activation sizing
    (`chunking.block_memory.Kernels` takes these fields)."""

    mlp: str  # "comfy" (linear_input_act's eager SwiGLU), "comfy_int8" (fused into fc2), "twin"
    attention_output_copy: bool


def block_kernels(model: Any = None, *, weight_format: str = "bfloat16") -> BlockKernels:
    """What the block's kernels allocate, for the chunking's sizing at run time and the planner.

    model: a ModelPatcher, its BaseModel, the DiT or one block (its first block is read:
    `mlp_kernel`); None, before anything is loaded: upstream H3's own block with DiT linears of
    `weight_format` (`weight_format`'s names), i.e. `linear_input_act`'s SwiGLU, fused into fc2
    for the INT8 formats it fuses. The attention output: ComfyUI internal: H3 calls
    `optimized_attention(..., skip_reshape=True)`, whose functions return
    `out.transpose(1, 2).reshape(b, -1, heads * dim_head)`; that reshape copies unless the
    backend wrote its output [B, S, H, D]-major, which nothing here reads, so it is counted.
    """
    block = _first_block(model)
    if block is not None:
        mlp = mlp_kernel(block)
    elif model is not None:
        raise ValueError(f"{type(model).__name__} has no H3 DiT block to read the kernels off")
    else:
        mlp = "comfy_int8" if weight_format in FUSED_FC2_FORMATS else "comfy"
    return BlockKernels(mlp=mlp, attention_output_copy=True)


def _first_block(model: Any) -> Any:
    """The first DiT block of a ModelPatcher (`get_model_object`), a BaseModel
    (`diffusion_model`), the DiT (`blocks`) or the block itself; None when there is none."""
    if model is None:
        return None
    if hasattr(model, "get_model_object"):
        model = model.get_model_object("diffusion_model")
    model = getattr(model, "diffusion_model", model)
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        return blocks[0] if len(blocks) else None
    return model if hasattr(model, "mlp") and hasattr(model, "attn") else None
