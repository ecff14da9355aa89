"""Every ComfyUI (and comfy-kitchen) internal the split video decode uses, one function each.

Each function names the internal and the releases it was read on: ComfyUI 0.33.0 (a full real
tree) and the newest stored upstream files. Nothing here imports ComfyUI at module import, so the
planner and the CPU tests import `decode` without it; when ComfyUI is absent each function says
so (None, or a `CoreMissing` naming what is missing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..comfy_seam import runtime


class CoreMissing(RuntimeError):
    """This ComfyUI lacks (or refuses) a core path the decode needs; the text says which."""


def model_management() -> Any | None:
    """`comfy.model_management` (0.33.0, newest files), or None outside ComfyUI."""
    return runtime.model_management()


def is_dynamic(patcher: Any) -> bool:
    """`ModelPatcher.is_dynamic()`: True for `ModelPatcherDynamic` (DynamicVRAM, comfy-aimdo),
    whose weights stay on the host and are cast into a VBAR at op time (0.33.0, newest files)."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def multi_gpu_clone(patcher: Any, device: torch.device) -> Any:
    """ComfyUI's own per-device copy of a model: `ModelPatcher.deepclone_multigpu(new_load_device=)`
    (0.33.0, newest files; what Select VAE Device and MultiGPU CFG Split use). It reloads the model
    from the loader's `cached_patcher_init` factory into a fresh patcher of the same class
    (`ModelPatcherDynamic` under DynamicVRAM, with its own VBAR on `device`), carrying the
    patches, so the helper never holds tensors shared with, or deep-copied from, VBAR-managed
    modules. Core unloads the source patcher and its clones first (`unload_model_and_clones`):
    call this before the VAE is loaded for a decode, never during one."""
    clone = getattr(patcher, "deepclone_multigpu", None)
    if not callable(clone):
        raise CoreMissing("this ComfyUI has no ModelPatcher.deepclone_multigpu (the multi-GPU "
                          "clone of 0.33.0 and the newest files)")
    if getattr(patcher, "cached_patcher_init", None) is None:
        raise CoreMissing("this VAE's loader registered no reload factory (cached_patcher_init), "
                          "so ComfyUI cannot clone it for another GPU: load it with Load VAE "
                          "(VAELoader) or a checkpoint loader")
    try:
        return clone(new_load_device=device)
    except RuntimeError as exc:  # core's own refusal, in its words
        raise CoreMissing(str(exc)) from exc


def load_for_decode(patcher: Any, memory_required: int) -> None:
    """`model_management.load_models_gpu([patcher], memory_required=...)`: ComfyUI loads a
    helper's clone on its own load device as VAE.decode loads the root (0.33.0, newest files).
    Not thread-safe in core: call it from the decode's own thread, before the workers start."""
    mm = model_management()
    if mm is None:
        raise CoreMissing("ComfyUI is not importable: nothing can load a clone")
    mm.load_models_gpu([patcher], memory_required=int(memory_required))


def loaded_bytes(patcher: Any) -> int:
    """`ModelPatcher.loaded_size()`: the weight bytes ComfyUI has on the patcher's load device
    now (0.33.0, newest files); 0 when the patcher cannot say."""
    size = getattr(patcher, "loaded_size", None)
    return int(size()) if callable(size) else 0


def free_bytes(device: torch.device, patcher: Any | None = None) -> int | None:
    """Free memory on `device` as ComfyUI counts it: `patcher.get_free_memory(device)` (adds
    aimdo's evictable VRAM under DynamicVRAM) or `model_management.get_free_memory(device)`
    (0.33.0, newest files). None outside ComfyUI."""
    query = getattr(patcher, "get_free_memory", None)
    if callable(query):
        return int(query(device))
    mm = model_management()
    return None if mm is None else int(mm.get_free_memory(device))


def make_room(need: int, device: torch.device) -> None:
    """`model_management.free_memory(need, device)`: ComfyUI unloads models there, as it does
    before any load (0.33.0, newest files)."""
    mm = model_management()
    if mm is not None:
        mm.free_memory(need, device)


def intermediate_device() -> torch.device:
    """`model_management.intermediate_device()`: where ComfyUI keeps decoded pixels (the host,
    or the GPU under --gpu-only); the VAE's own decode_temporal allocates there too."""
    mm = model_management()
    return mm.intermediate_device() if mm is not None else torch.device("cpu")


def progress_and_interrupt(steps: int):
    """ComfyUI's progress bar (`comfy.utils.ProgressBar(steps).update`) and interrupt check
    (`model_management.throw_exception_if_processing_interrupted`), each None outside ComfyUI
    (0.33.0, newest files)."""
    utils = runtime.utils()
    progress = utils.ProgressBar(steps).update if utils is not None else None
    mm = model_management()
    return progress, (mm.throw_exception_if_processing_interrupted if mm is not None else None)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really holds. A comfy-kitchen `QuantizedTensor` (ComfyUI's INT8 ConvRot
    weights, `ops.mixed_precision_ops`) reports its logical dtype, so `numel * element_size`
    counts an int8 weight at its bf16/fp16 size; its storage is `_qdata` plus the tensors of its
    layout `_params` (the scales). Read on comfy-kitchen 0.2.31 (the 0.33.0 bed) and 0.2.40."""
    qdata = getattr(tensor, "_qdata", None)
    params = getattr(tensor, "_params", None)
    if isinstance(qdata, torch.Tensor) and dataclasses.is_dataclass(params):
        extra = (getattr(params, f.name) for f in dataclasses.fields(params))
        return qdata.nbytes + sum(t.nbytes for t in extra if isinstance(t, torch.Tensor))
    return tensor.numel() * tensor.element_size()
