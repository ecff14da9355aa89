"""ComfyUI's model management as the nodes and the split decode call it: loading a patcher,
making room, unloading the text encoder, the devices it computes on, where outputs go, progress.

Each function names the ComfyUI internal it calls and the releases it was read on (ComfyUI
0.33.0 and the newest stored files; each in `internals.INTERNALS`, resolved per release by a
`comfyui` test). These serve code that runs inside ComfyUI only (a node's execute, the VAE's
decode), so they reach `comfy.model_management` with `runtime.model_management(importing=True)`
as those callers always did; outside ComfyUI each says so (None, a fallback, or
`ComfyUIMissing`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import runtime


class ComfyUIMissing(RuntimeError):
    """ComfyUI's model management is not importable here; the text says what needed it."""


def _mm() -> Any:
    return runtime.model_management(importing=True)


def load(patchers: list[Any], memory_required: int | None = None) -> None:
    """`model_management.load_models_gpu(patchers[, memory_required=])`: ComfyUI loads each
    patcher on its own load device, as its nodes do before they run a model. Not thread-safe
    in core: call it from the thread ComfyUI runs the node on."""
    mm = _mm()
    if mm is None:
        raise ComfyUIMissing("ComfyUI is not importable: nothing can load a clone")
    if memory_required is None:
        mm.load_models_gpu(patchers)
    else:
        mm.load_models_gpu(patchers, memory_required=int(memory_required))


def loaded_bytes(patcher: Any) -> int:
    """`ModelPatcher.loaded_size()`: the weight bytes ComfyUI has on the patcher's load device
    now (DynamicVRAM: its VBAR's too); 0 when the patcher cannot say."""
    size = getattr(patcher, "loaded_size", None)
    return int(size()) if callable(size) else 0


def free_bytes(device: torch.device, patcher: Any | None = None) -> int | None:
    """Free memory on `device` as ComfyUI counts it: `patcher.get_free_memory(device)` (adds
    aimdo's evictable VRAM under DynamicVRAM) or `model_management.get_free_memory(device)`.
    None outside ComfyUI. (`memory.free_vram_bytes` is the features' reading, capped by a
    memory fraction; this is the decode's, uncapped, as ComfyUI's own loads see it.)"""
    query = getattr(patcher, "get_free_memory", None)
    if callable(query):
        return int(query(device))
    mm = _mm()
    return None if mm is None else int(mm.get_free_memory(device))


def make_room(need: int, device: torch.device) -> None:
    """`model_management.free_memory(need, device)`: ComfyUI unloads models there, as it does
    before any load; nothing outside ComfyUI."""
    mm = _mm()
    if mm is not None:
        mm.free_memory(need, device)


def intermediate_device() -> torch.device:
    """`model_management.intermediate_device()`: where ComfyUI keeps decoded pixels (the host,
    or the GPU under --gpu-only); the CPU outside ComfyUI."""
    mm = _mm()
    return mm.intermediate_device() if mm is not None else torch.device("cpu")


def progress_bar(steps: int) -> Callable[[int], None] | None:
    """`comfy.utils.ProgressBar(steps).update` (the node's progress in the UI), or None outside
    ComfyUI."""
    utils = runtime.utils()
    return utils.ProgressBar(steps).update if utils is not None else None


# ------------------------------------------------------------------------------ devices
def torch_device() -> torch.device:
    """`model_management.get_torch_device()`: the device ComfyUI computes on by default."""
    return _mm().get_torch_device()


def default_device() -> torch.device | None:
    """ComfyUI's default compute device (`get_torch_device`), None outside ComfyUI."""
    mm = runtime.model_management(importing=True)
    return None if mm is None else mm.get_torch_device()


def should_use_fp16(device: torch.device) -> bool:
    """`model_management.should_use_fp16(device)`: whether ComfyUI runs fp16 on `device`."""
    return bool(_mm().should_use_fp16(device))


def offload_device() -> torch.device:
    """`model_management.unet_offload_device()`: where ComfyUI keeps a model it unloads."""
    return _mm().unet_offload_device()


def gpu_device_options() -> list[str] | None:
    """ComfyUI's device choices ("default", "cpu", "gpu:N"; `get_gpu_device_options()`), or
    None on a ComfyUI without them or outside ComfyUI."""
    options = getattr(_mm(), "get_gpu_device_options", None)
    return list(options()) if options is not None else None


def resolve_gpu_option(option: str) -> torch.device | None:
    """The torch.device ComfyUI means by "gpu:N" (`resolve_gpu_device_option`), or None when
    this ComfyUI cannot say (or does not know the GPU)."""
    resolve = getattr(_mm(), "resolve_gpu_device_option", None)
    return resolve(option) if resolve is not None else None


def patcher_class(disable_dynamic: bool = False) -> type:
    """The patcher class ComfyUI loads its own models with: `comfy.model_patcher.
    CoreModelPatcher` (`ModelPatcherDynamic` under DynamicVRAM), the plain ModelPatcher when a
    non-dynamic copy is asked for or on a ComfyUI without it."""
    patchers = runtime.model_patcher()
    plain = patchers.ModelPatcher
    return plain if disable_dynamic else getattr(patchers, "CoreModelPatcher", plain)


# ------------------------------------------------------------------------------ unloading
def release(patcher: Any) -> tuple[Any, int] | None:
    """Unload `patcher`'s weights (and its clones') from its GPU, and nothing else: returns
    (the device, how many models ComfyUI unloaded), or None when it is not loaded anywhere.

    Public model_management calls only: `current_loaded_models` (entries with `.model`,
    `.device`; `ModelPatcher.is_clone`), `free_memory(bytes, device, keep_loaded=)` asked for
    twice the card (`get_total_memory`), so it unloads every model it may touch and
    `keep_loaded` limits that to this one, then `soft_empty_cache()`. ComfyUI reloads the
    model by itself when a node needs it again."""
    mm = _mm()
    if mm is None:
        raise ComfyUIMissing("ComfyUI's model management is not importable")
    loaded = list(getattr(mm, "current_loaded_models", []))
    mine = [lm for lm in loaded if lm.model is not None
            and (lm.model is patcher or lm.model.is_clone(patcher))]
    if not mine:
        return None
    device = mine[0].device
    keep = [lm for lm in loaded if lm not in mine]
    unloaded = mm.free_memory(mm.get_total_memory(device) * 2, device, keep_loaded=keep)
    mm.soft_empty_cache()
    return device, len(unloaded)


def empty_cache() -> None:
    """Give torch's cached GPU blocks back: ComfyUI's `soft_empty_cache()` when ComfyUI runs
    here (it knows the backend), else `torch.cuda.empty_cache()` on an initialised CUDA."""
    mm = runtime.model_management()
    if mm is not None and hasattr(mm, "soft_empty_cache"):
        mm.soft_empty_cache()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
