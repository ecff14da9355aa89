"""Building a plan from node inputs (pure; the planner is imported when used)."""

from __future__ import annotations

from typing import Any


class PlannerUnavailable(RuntimeError):
    """The planner package is not importable in this install."""


def profiles() -> list[str]:
    """Hardware profile names the planner knows ([] when the planner is missing)."""
    try:
        from ..planner import list_profiles
    except ImportError:
        return []
    return list(list_profiles())


def make_plan(*, pass2_width: int, pass2_height: int, pass1_width: int, pass1_height: int,
              seconds: float, devices: str, lora_rank: int, parallel: str = "auto",
              dynamic_vram: str = "auto", pinned_budget_bytes: int | None = None,
              attention: str = "auto", model_request: dict[str, Any] | None = None,
              one_pass: bool = False, pass1_cfg: float = 1.0, pass2_cfg: float = 1.0) -> Any:
    """plan_job for the two-pass job; ValueError for bad input, PlannerUnavailable if absent.
    `dynamic_vram` / `pinned_budget_bytes` / `attention`: what this ComfyUI runs with
    (`comfy_loader_inputs`); attention "auto" on this machine is what ComfyUI would run.
    `model_request`: PlanRequest fields read from the loaded model (its weight format);
    `one_pass`: the graph samples once (no PASS1 before an upscale); `pass1_cfg` /
    `pass2_cfg`: each pass's guidance scale (above 1 the plan weighs CFG split)."""
    try:
        from ..planner import PlanRequest, plan_job
    except ImportError as exc:
        raise PlannerUnavailable(f"the planner is not importable ({exc})") from exc
    if attention == "auto" and devices == "auto":
        attention = comfy_attention() or "auto"
    profile = this_server_profile() if devices == "auto" else devices
    request = PlanRequest(width=pass2_width, height=pass2_height, seconds=seconds,
                          pass1_width=pass1_width, pass1_height=pass1_height,
                          profile=profile, lora_rank=lora_rank, parallel=parallel,
                          dynamic_vram=dynamic_vram, pinned_budget_bytes=pinned_budget_bytes,
                          attention=attention, pass1_cfg=pass1_cfg, pass2_cfg=pass2_cfg,
                          **(model_request or {}),
                          **({"pass1_steps": 0} if one_pass else {}))
    return plan_job(request)


def no_gpu_message() -> str:
    """devices='auto' on a server with no GPU ComfyUI computes on, in the node's words."""
    return ("devices='auto': this server has no GPU that ComfyUI computes on (no CUDA/ROCm GPU, "
            "or ComfyUI started with --cpu); set devices to a profile name (" + ", ".join(
                profiles()) + ") to plan for hardware this server does not have")


def this_server_profile() -> Any:
    """This server's GPUs as the planner's profile, each with the memory ComfyUI may use on it
    (the card less `--reserve-vram`, capped by a per-process memory fraction): the plan is
    made for the budget, not for the card."""
    from dataclasses import replace

    from ..comfy_seam.memory import vram_budget
    from ..planner.hardware import detect_hardware
    from .devices import gpu_inventory

    if not gpu_inventory():
        raise ValueError(no_gpu_message())
    profile = detect_hardware()
    budgets = [vram_budget(i) for i in range(profile.gpu_count)]
    gpus = tuple(replace(g, memory_bytes=b.budget_bytes) for g, b in zip(profile.gpus, budgets,
                                                                         strict=True))
    limited = [f"gpu:{b.index} {b.describe()}" for b in budgets if b.limits]
    notes = (*profile.notes, *(f"planned for ComfyUI's budget: {line}" for line in limited))
    return replace(profile, gpus=gpus, notes=notes)


def comfy_loader_inputs(devices: str, patcher: Any = None) -> dict[str, Any]:
    """The loader and pin budget this ComfyUI runs with, as make_plan's keywords: DynamicVRAM
    from `patcher.is_dynamic()` (else ComfyUI's `aimdo_enabled`) and ComfyUI's
    MAX_PINNED_MEMORY; and `attention` when the patcher's checkpoint prefers a kernel. Only
    for devices 'auto' (this machine): a profile name previews other hardware, planned by
    that profile's defaults. Empty outside ComfyUI."""
    if devices != "auto":
        return {}
    from ..comfy_seam.memory import comfy_pin_budget, dynamic_vram_enabled, is_dynamic

    out: dict[str, Any] = {}
    dynamic = is_dynamic(patcher) if patcher is not None else dynamic_vram_enabled()
    if dynamic is not None:
        out["dynamic_vram"] = "on" if dynamic else "off"
    budget = comfy_pin_budget()
    if budget is not None:
        out["pinned_budget_bytes"] = max(budget.limit_bytes, 0)  # <= 0: ComfyUI pins nothing
    preferred = checkpoint_attention(patcher) if patcher is not None else None
    if preferred is not None:
        out["attention"] = preferred
    return out


# ComfyUI's attention functions (comfy/ldm/modules/attention.py: chosen at import by its flags,
# --use-sage-attention, --use-flash-attention, --use-ck-attention, else attention_pytorch;
# checked on 0.33.0 and the newest files) -> the planner's kernel names
COMFY_ATTENTION_KERNELS = {
    "attention_pytorch": "sdpa", "attention_flash": "flash", "attention_sage": "sage",
    "attention3_sage": "sage", "attention_comfy_kitchen_int8": "ck",
    "attention_xformers": "flash",  # xformers runs FlashAttention kernels on CUDA
}


def comfy_attention() -> str | None:
    """The kernel ComfyUI's `optimized_attention` runs here, or None outside ComfyUI (its
    attention module is read only once ComfyUI imported it) or for a kernel the planner has no
    rates for (split / sub-quadratic attention: CPU and old GPUs)."""
    from ..comfy_seam.runtime import loaded_optimized_attention

    function = loaded_optimized_attention()
    if function is None:
        return None
    return COMFY_ATTENTION_KERNELS.get(getattr(function, "__name__", ""))


def checkpoint_attention(patcher: Any) -> str | None:
    """The kernel the loaded checkpoint prefers, or None (the newest files only).

    ComfyUI internal: each H3 attention module's `comfy_attention` (ComfyAttention, newest
    comfy/ldm/modules/attention.py; absent in 0.33.0) holds `function` when the checkpoint's
    attention config names a kernel available here (comfy_kitchen_int8)."""
    model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    blocks = getattr(model, "blocks", None)
    if not blocks:
        return None
    preferred = getattr(getattr(getattr(blocks[0], "attn", None), "comfy_attention", None),
                        "function", None)
    return COMFY_ATTENTION_KERNELS.get(getattr(preferred, "__name__", ""))
