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
              dynamic_vram: str = "auto", pinned_budget_bytes: int | None = None) -> Any:
    """plan_job for the two-pass job; ValueError for bad input, PlannerUnavailable if absent.
    `dynamic_vram` / `pinned_budget_bytes`: what this ComfyUI runs with (`comfy_loader_inputs`)."""
    try:
        from ..planner import PlanRequest, plan_job
    except ImportError as exc:
        raise PlannerUnavailable(f"the planner is not importable ({exc})") from exc
    request = PlanRequest(width=pass2_width, height=pass2_height, seconds=seconds,
                          pass1_width=pass1_width, pass1_height=pass1_height,
                          profile=devices, lora_rank=lora_rank, parallel=parallel,
                          dynamic_vram=dynamic_vram, pinned_budget_bytes=pinned_budget_bytes)
    return plan_job(request)


def comfy_loader_inputs(devices: str, patcher: Any = None) -> dict[str, Any]:
    """The loader and pin budget this ComfyUI runs with, as make_plan's keywords: DynamicVRAM
    from `patcher.is_dynamic()` (else ComfyUI's `aimdo_enabled`) and ComfyUI's
    MAX_PINNED_MEMORY. Only for devices 'auto' (this machine): a profile name previews other
    hardware, planned by that profile's defaults. Empty outside ComfyUI."""
    if devices != "auto":
        return {}
    from ..offload.comfy_memory import comfy_pin_budget, dynamic_vram_enabled, is_dynamic

    out: dict[str, Any] = {}
    dynamic = is_dynamic(patcher) if patcher is not None else dynamic_vram_enabled()
    if dynamic is not None:
        out["dynamic_vram"] = "on" if dynamic else "off"
    budget = comfy_pin_budget()
    if budget is not None:
        out["pinned_budget_bytes"] = max(budget.limit_bytes, 0)  # <= 0: ComfyUI pins nothing
    return out
