"""ComfyUI's memory seams: free VRAM, its pinned-memory budget, and whether DynamicVRAM streams.

Every ComfyUI memory internal the pack uses goes through one small function here, each
feature-detected and named with the releases it was read on (ComfyUI 0.33.0 and the newest
stored Comfy-Org files). Where ComfyUI does the job, the pack asks ComfyUI instead of keeping
a second count:
- free VRAM: `ModelPatcher.get_free_memory(device)` counts what comfy-aimdo could evict from
  its VBARs (DynamicVRAM) on top of `model_management.get_free_memory(device)`;
  `torch.cuda.mem_get_info` sees neither that nor torch's cached blocks;
- pinned memory: ComfyUI page-locks host memory within one budget (`MAX_PINNED_MEMORY`,
  cgroup-aware on the newest files through `comfy.system_memory`), counting it in
  `TOTAL_PINNED_MEMORY`. The prefetcher's host copies are pinned through ComfyUI's own
  `pin_memory` / `unpin_memory`, so they are booked in that budget and refused past it;
- DynamicVRAM: `comfy.memory_management.aimdo_enabled` (main.py sets it when it swaps
  `CoreModelPatcher` for `ModelPatcherDynamic`) and `patcher.is_dynamic()`.

Outside ComfyUI (the CLI, the twin tests, the benchmarks) ComfyUI is not imported: free VRAM
is torch's, pins are registered with `cudaHostRegister` directly and budgets are the caller's.
"Inside ComfyUI" means ComfyUI's `comfy.model_management` is already imported in this process
(ComfyUI imports it before any custom node); this module never imports ComfyUI itself.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from . import runtime

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device, not only the current


# ------------------------------------------------------------------------------ free VRAM
def free_vram_bytes(device: torch.device | str, patcher: Any = None) -> int | None:
    """Bytes a new allocation on `device` can get, as ComfyUI counts them; None off-GPU.

    Inside ComfyUI: `patcher.get_free_memory(device)` (ComfyUI 0.33.0 and newest: torch's free
    and cached memory plus comfy-aimdo's evictable VBAR pages under DynamicVRAM) for `patcher`,
    or else for the patcher ComfyUI has loaded on `device`; without one,
    `model_management.get_free_memory(device)`. Outside ComfyUI: the driver's free memory
    (`torch.cuda.mem_get_info`). A per-process memory fraction (an emulated smaller card) caps
    the answer at what torch's allocator may still reserve.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    mm = runtime.model_management()
    if mm is not None and hasattr(mm, "get_free_memory"):
        query = getattr(patcher, "get_free_memory", None) or _loaded_patcher_query(mm, device)
        free = int(query(device)) if query is not None else int(mm.get_free_memory(device))
    else:
        free, _ = torch.cuda.mem_get_info(device)
    return max(_fraction_capped(device, free), 0)


def _loaded_patcher_query(mm: Any, device: torch.device) -> Any | None:
    """`get_free_memory` of a patcher ComfyUI has loaded on `device` (0.33.0, newest:
    `current_loaded_models` entries with `.device` and `.model`), the query that counts
    DynamicVRAM's evictable memory; None when nothing is loaded there."""
    for loaded in list(getattr(mm, "current_loaded_models", ())):
        patcher = getattr(loaded, "model", None)
        if patcher is not None and str(getattr(loaded, "device", None)) == str(device):
            query = getattr(patcher, "get_free_memory", None)
            if query is not None:
                return query
    return None


def _fraction_capped(device: torch.device, free: int) -> int:
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is None or not torch.cuda.is_initialized():
        return free  # a fraction is set on an initialised device; do not initialise CUDA here
    fraction = float(get_fraction(device))
    if fraction >= 1.0:
        return free
    total = torch.cuda.get_device_properties(device).total_memory
    # torch refuses to reserve past total * fraction; cached blocks are not counted there (they
    # are often fragments too small for a multi-GiB activation)
    return min(free, int(total * fraction) - torch.cuda.memory_reserved(device))


# ------------------------------------------------------------------------------ the budget
def comfy_runs_on_cpu() -> bool | None:
    """True when ComfyUI computes on the CPU although torch may see GPUs (`--cpu`: 0.33.0 and
    newest `model_management.get_torch_device()` is the CPU); None outside ComfyUI."""
    mm = runtime.model_management()
    if mm is None or not hasattr(mm, "get_torch_device"):
        return None
    return torch.device(mm.get_torch_device()).type == "cpu"


@dataclass(frozen=True)
class VramBudget:
    """What one GPU may hold for this ComfyUI: the card less what the process may not take."""

    index: int
    total_bytes: int
    budget_bytes: int
    limits: tuple[str, ...]  # what lowers it below the card, in words ("" when nothing)

    def describe(self) -> str:
        gib = 1024**3
        if not self.limits:
            return f"all {self.total_bytes / gib:.1f} GiB"
        return (f"{self.budget_bytes / gib:.1f} of {self.total_bytes / gib:.1f} GiB "
                f"({'; '.join(self.limits)})")


def vram_budget(index: int) -> VramBudget:
    """gpu:`index`'s memory as this process may use it: the card, capped by torch's
    per-process memory fraction (an emulated smaller card) and less ComfyUI's
    `--reserve-vram` (0.33.0 and newest: `model_management.EXTRA_RESERVED_VRAM`, which
    ComfyUI keeps free beside every model it loads)."""
    gib = 1024**3
    total = int(torch.cuda.get_device_properties(index).total_memory)
    budget, limits = total, []
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None and torch.cuda.is_initialized():
        fraction = float(get_fraction(index))
        if fraction < 1.0:
            budget = int(total * fraction)
            limits.append(f"torch memory fraction {fraction:.3g}: {budget / gib:.1f} GiB")
    mm = runtime.model_management()
    reserved = int(getattr(mm, "EXTRA_RESERVED_VRAM", 0) or 0) if mm is not None else 0
    if reserved > 0:
        limits.append(f"ComfyUI keeps {reserved / gib:.1f} GiB free (--reserve-vram)")
        budget = min(budget, total - reserved)
    return VramBudget(index, total, max(budget, 0), tuple(limits))


# ------------------------------------------------------------------------------ DynamicVRAM
def dynamic_vram_enabled() -> bool | None:
    """ComfyUI's DynamicVRAM switch (`comfy.memory_management.aimdo_enabled`, 0.33.0 and
    newest: main.py sets it with `CoreModelPatcher = ModelPatcherDynamic`); None outside
    ComfyUI or on a ComfyUI without DynamicVRAM."""
    memory = sys.modules.get("comfy.memory_management")
    if memory is None or not hasattr(memory, "aimdo_enabled"):
        return None
    return bool(memory.aimdo_enabled)


def is_dynamic(patcher: Any) -> bool:
    """A DynamicVRAM patcher (`ModelPatcherDynamic.is_dynamic()`, 0.33.0 and newest): ComfyUI
    streams its weights itself (VBAR per device, one block of look-ahead)."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def comfy_block_prefetch() -> str:
    """What ComfyUI's own DynamicVRAM block prefetch does in this process (0.33.0 and newest:
    `comfy.model_prefetch.make_prefetch_queue` stages the next DiT block while one runs, only
    with offload streams, `model_management.NUM_STREAMS` > 0)."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    if prefetch is None or not hasattr(prefetch, "make_prefetch_queue"):
        return "this ComfyUI has no block prefetch: each layer is cast when it runs"
    mm = runtime.model_management()
    if mm is not None and getattr(mm, "NUM_STREAMS", 1) == 0:
        return ("ComfyUI's block prefetch is off (no offload streams: --disable-async-offload): "
                "each layer is cast when it runs")
    return "ComfyUI stages the next DiT block while one runs (make_prefetch_queue, one ahead)"


def dynamic_vram_line(patcher: Any) -> str:
    """'streaming: ComfyUI DynamicVRAM (...)': what ComfyUI does with a dynamic patcher."""
    device = getattr(patcher, "load_device", "its GPU")
    pins = comfy_pin_budget()
    pinned = pins.describe() if pins is not None else "ComfyUI's pin budget"
    return (f"streaming: ComfyUI DynamicVRAM (comfy-aimdo VBAR on {device}: the weights stay in "
            "host memory and are cast onto the GPU as each layer runs, what fits stays resident "
            f"and is evicted on demand; {comfy_block_prefetch()}; host copies pinned by ComfyUI "
            f"within {pinned})")


# ------------------------------------------------------------------------------ pinned memory
@dataclass(frozen=True)
class PinBudget:
    """ComfyUI's page-locked host memory: its limit and what is pinned now (all users)."""

    limit_bytes: int  # MAX_PINNED_MEMORY; <= 0 when ComfyUI pins nothing
    used_bytes: int  # TOTAL_PINNED_MEMORY

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    @property
    def left_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    def describe(self) -> str:
        gib = 1 << 30
        if not self.enabled:
            return "ComfyUI pins no host memory (--disable-pinned-memory or no CUDA/ROCm)"
        return (f"ComfyUI's pin budget {self.limit_bytes / gib:.1f} GiB "
                f"({self.used_bytes / gib:.1f} GiB pinned now)")


def comfy_pin_budget() -> PinBudget | None:
    """ComfyUI's pin budget (`model_management.MAX_PINNED_MEMORY` / `TOTAL_PINNED_MEMORY`,
    0.33.0 and newest; the newest derives the limit from a cgroup memory limit when there is
    one), or None outside ComfyUI."""
    mm = runtime.model_management()
    if mm is None or not hasattr(mm, "MAX_PINNED_MEMORY"):
        return None
    return PinBudget(int(mm.MAX_PINNED_MEMORY), int(getattr(mm, "TOTAL_PINNED_MEMORY", 0)))


def pin_budget_bytes(requested: int | None) -> int | None:
    """The pinned bytes a new set of host copies may take: inside ComfyUI what is left of its
    budget (capping `requested`, 0 when ComfyUI pins nothing); outside it `requested`."""
    budget = comfy_pin_budget()
    if budget is None:
        return requested
    left = budget.left_bytes if budget.enabled else 0
    return left if requested is None else min(requested, left)


def _comfy_pinning(mm: Any) -> bool:
    return mm is not None and hasattr(mm, "pin_memory") and hasattr(mm, "unpin_memory") \
        and hasattr(mm, "MAX_PINNED_MEMORY")


def pin_host(region_u8: torch.Tensor) -> tuple[bool, bool]:
    """Page-lock a CPU tensor's memory in place. Returns (pinned, booked in ComfyUI).

    Inside ComfyUI: through `model_management.pin_memory` (0.33.0 and newest: it registers the
    memory and adds it to TOTAL_PINNED_MEMORY), only while ComfyUI's budget has room (after
    ComfyUI frees its own inactive pins for it, `ensure_pin_registerable`). Outside ComfyUI:
    `cudaHostRegister`. Never raises: a refusal leaves the memory pageable.
    """
    if region_u8.numel() == 0:
        return False, False
    mm = runtime.model_management()
    if _comfy_pinning(mm):
        return _pin_in_comfy(mm, region_u8), True
    if not torch.cuda.is_available():
        return False, False
    try:
        status = torch.cuda.cudart().cudaHostRegister(region_u8.data_ptr(), region_u8.numel(),
                                                      _PORTABLE)
    except (AttributeError, AssertionError, RuntimeError) as error:
        log.warning("page locking unavailable (%s); using pageable memory", error)
        return False, False
    return int(status) == 0, False


def _pin_in_comfy(mm: Any, region_u8: torch.Tensor) -> bool:
    size = region_u8.numel()
    if mm.MAX_PINNED_MEMORY <= 0:
        return False  # ComfyUI pins nothing: neither do we
    if mm.TOTAL_PINNED_MEMORY + size > mm.MAX_PINNED_MEMORY:
        # ComfyUI can give back registrations of its own inactive (DynamicVRAM) pins
        make_room = getattr(mm, "ensure_pin_registerable", None)
        if make_room is not None:
            make_room(size)
        if mm.TOTAL_PINNED_MEMORY + size > mm.MAX_PINNED_MEMORY:
            return False
    return bool(mm.pin_memory(region_u8))


def unpin_host(region_u8: torch.Tensor, booked: bool) -> None:
    """Undo `pin_host`: through ComfyUI's `unpin_memory` when it was booked there (the
    budget gets the bytes back), else `cudaHostUnregister`."""
    if booked:
        runtime.model_management().unpin_memory(region_u8)
    else:
        torch.cuda.cudart().cudaHostUnregister(region_u8.data_ptr())

