"""ComfyUI's multi-GPU clones: the pack's one clone path (`make_clone`, `retarget`), serving the
sequence mode's helpers, the split decode's helpers and the placement node, and every ComfyUI
internal the sequence mode's helper clones use.

Checked on ComfyUI 0.33.0 and the newest-files bed (each listed in `internals.INTERNALS`, which
a `comfyui` test resolves on each release); each use is feature-detected and degrades as stated:

- `ModelPatcher.deepclone_multigpu(new_load_device=)` (comfy/model_patcher.py): a fresh model
  from the loader's `cached_patcher_init` factory, as ComfyUI's MultiGPU CFG Split builds its
  per-GPU clones (comfy/multigpu.py `create_multigpu_deepclones`). Missing, or the model's
  loader has no factory (`cached_patcher_init is None`): `clone_refusal` says so and the mode
  binds the helper weights itself (`weights.py`), the decode says so in its own words, and the
  placement node falls back to a clone whose `load_device` is the target (`retarget`).
- `ModelPatcherDynamic.register_load_device(device)` (DynamicVRAM's per-device pin
  bookkeeping; comfy_extras/nodes_multigpu.py calls it after retargeting): called when present,
  as `deepclone_multigpu` itself does (the plain ModelPatcher has none).
- `ModelPatcher.clone(model_override=other.get_clone_model_override())`: what
  `match_multigpu_clones` does before every sampling run, so a helper clone carries the root
  patcher's weight patches (LoRA), injections (on-activation LoRA) and hook patches while
  keeping its own model, backups and DynamicVRAM state.
- `ModelPatcher.set_additional_models / get_additional_models_with_key /
  remove_additional_models`: the helper clones ride as additional models under `CLONES_KEY`, so
  `prepare_sampling` loads them (`get_nested_additional_models` -> `load_models_gpu`: LoRA
  patching, lowvram, DynamicVRAM VBARs) and `cleanup_models` cleans them up. The key is ours,
  not "multigpu": that one also switches on ComfyUI's CFG split (`is_multigpu_base_clone`).
- `ModelPatcher.injections` / `PatcherInjection.inject`: the on-activation ("bypass") LoRA's
  injection is bound to the root's modules; it is rebuilt for the clone through the
  `BypassInjectionManager` in its closure (`_rebind_injections`), else left off and named.
- `ModelPatcher.object_patches`: a helper clone would apply the root's object patches to its
  own modules; one holding the root's module (the pack's chunked block forward) is rebound
  through its `h3_multigpu_rebind(module)` when it has one, else left off (`match_clone`).
- `comfy.model_management.free_memory(bytes, device)`: before the mode sizes a helper's weights,
  ComfyUI is asked to make room there (`ask_to_free`).
- `comfy.model_management.current_loaded_models` and `free_memory(bytes, device, keep_loaded=)`:
  frees a helper clone's device copy after sampling (`keep_weights` off), keeping every other
  model (`unload_model_and_clones` would also unload the root: the clones share its
  `clone_base_uuid`).
- ComfyUI's interrupt (`interrupts`): the shares' rendezvous honours it; the block module's
  `AttentionTensorContainer` (`container`), `model_management.in_training` (`h3.in_training`).
- `transformer_options["optimized_attention_override"]` (comfy/ldm/modules/attention.py
  `wrap_attn`): called as `override(func, q, k, v, heads, **kwargs)` with the tensors taken out
  of their containers unless the override has `container_function`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from . import runtime
from .names import CLONES_KEY, MULTIGPU_CLONES, REBIND, SELECT_BASE_DEVICE

NO_CLONES = "no deepclone_multigpu"  # clone_gap: this ComfyUI makes no multi-GPU clones
NO_FACTORY = "no cached_patcher_init"  # clone_gap: this model's loader left no reload factory


def clone_gap(patcher: Any) -> str | None:
    """What ComfyUI lacks to make a multi-GPU clone of this patcher: `NO_CLONES`, `NO_FACTORY`,
    or None (it can; core may still refuse, `make_clone` raises its RuntimeError then)."""
    if not callable(getattr(patcher, "deepclone_multigpu", None)):
        return NO_CLONES
    if getattr(patcher, "cached_patcher_init", None) is None:
        return NO_FACTORY
    return None


def clone_refusal(patcher: Any) -> str | None:
    """Why ComfyUI cannot make a helper clone of this patcher (None: it can)."""
    gap = clone_gap(patcher)
    if gap == NO_CLONES:
        return "this ComfyUI has no multi-GPU clones (ModelPatcher.deepclone_multigpu)"
    if gap == NO_FACTORY:
        return ("this model's loader registers no reload factory (cached_patcher_init); load it "
                "with a core loader (UNETLoader, CheckpointLoaderSimple)")
    return None


def make_clone(patcher: Any, device: torch.device) -> Any:
    """A ComfyUI-managed copy of the model for `device`, from the loader's factory: the one
    multi-GPU clone of the pack (the sequence mode's helpers, the split decode's helpers, the
    placement node). Raises core's RuntimeError when the loader left no factory, and an
    AttributeError on a ComfyUI without multi-GPU clones (`clone_gap` says which first)."""
    clone = patcher.deepclone_multigpu(new_load_device=device)
    _register_load_device(clone, clone.load_device)
    # a clone of a root in the sequence mode would carry the root's helpers as its own
    remove = getattr(clone, "remove_additional_models", None)
    if remove is not None:
        remove(CLONES_KEY)
    return clone


def _register_load_device(patcher: Any, device: Any) -> None:
    """`ModelPatcherDynamic.register_load_device` (0.33.0, newest): DynamicVRAM keeps its pins
    per device and fails in `partially_unload_ram` for a device it never registered. Idempotent
    (core's deepclone_multigpu calls it too); plain patchers have none."""
    register = getattr(patcher, "register_load_device", None)
    if register is not None:
        register(device)


def retarget(patcher: Any, target: torch.device) -> tuple[Any, str]:
    """A patcher whose load device is `target` and how it was made: ComfyUI's multi-GPU clone
    (`make_clone`) where it can make one, else a clone whose `load_device` is the target
    (registered with DynamicVRAM), the reason said. The input patcher is left untouched."""
    reason = "this ComfyUI has no deepclone_multigpu"
    if clone_gap(patcher) != NO_CLONES:
        try:
            return make_clone(patcher, target), "deepclone_multigpu"
        except RuntimeError as exc:  # loaders without a reload factory cannot deepclone
            reason = f"deepclone_multigpu refused ({exc})"
    clone = patcher.clone()
    clone.load_device = target
    _register_load_device(clone, target)
    return clone, f"load_device set on a clone ({reason})"


def match_clone(root: Any, base: Any) -> tuple[Any, list[str]]:
    """A clone of `root` (its patches, injections, hooks, options) on `base`'s model and device,
    as ComfyUI's `match_multigpu_clones`; returns it and the object patches left off."""
    clone = root.clone(model_override=base.get_clone_model_override())
    clone.load_device = base.load_device
    clone.hook_backup = base.hook_backup
    clone.remove_additional_models(CLONES_KEY)
    clone.remove_additional_models(MULTIGPU_CLONES)
    left_off = _rebind_injections(clone, base)
    for key, value in list(clone.object_patches.items()):
        if not key.startswith("diffusion_model.blocks."):
            continue
        rebind = getattr(value, REBIND, None)
        owner = _owner(base.model, key)
        if rebind is not None and owner is not None:
            clone.object_patches[key] = rebind(owner)
        else:
            del clone.object_patches[key]
            left_off.append(key)
    return clone, left_off


def _rebind_injections(clone: Any, base: Any) -> list[str]:
    """The root's injections rebuilt for the clone's own modules; returns those left off.

    ComfyUI builds an injection for one model: its on-activation ("bypass") LoRA's
    `BypassInjectionManager.create_injections(model)` binds hooks to that model's modules
    (comfy/weight_adapter/bypass.py, 0.33.0), and its `inject` moves the adapters' weights to
    `get_torch_device()`, the current device. Copied as is, the clone would inject the root's
    modules again. A manager found in the injection's closure is copied (its adapters too,
    so each device holds its own weights), asked for the clone's injections, and those run
    with the clone's device current. Any other injection is left off (and named)."""
    left_off = []
    for key, injections in list(clone.injections.items()):
        rebuilt = []
        for injection in injections:
            manager = _closure_object(getattr(injection, "inject", None), "create_injections")
            if manager is None:
                left_off.append(f"injection {key}")
                continue
            mine = copy.copy(manager)
            mine.hooks = []
            mine.adapters = {k: (copy.copy(adapter), strength)
                             for k, (adapter, strength) in manager.adapters.items()}
            for new in mine.create_injections(base.model):
                rebuilt.append(_on_device(new, base.load_device))
        clone.injections[key] = rebuilt
    return left_off


def _closure_object(fn: Any, method: str) -> Any:
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(getattr(value, method, None)) and hasattr(value, "adapters"):
            return value
    return None


def _on_device(injection: Any, device: torch.device) -> Any:
    from .devices import device_context

    inject, eject = injection.inject, injection.eject

    def inject_here(patcher: Any) -> Any:
        with device_context(device):
            return inject(patcher)

    injection.inject, injection.eject = inject_here, eject
    return injection


def _owner(model: torch.nn.Module, key: str) -> Any:
    """The module that `key` ("a.b.forward") patches an attribute of."""
    obj: Any = model
    for part in key.split(".")[:-1]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def set_clones(owner: Any, clones: list[Any]) -> None:
    """The helper clones as additional models of `owner` (the root, or the CFG Split copy that
    leads them: `match_multigpu_clones` carries a copy's additional models to the copy it
    rebuilds, and deep-clones onto it only root models of a `clone_base_uuid` it has none of)."""
    owner.set_additional_models(CLONES_KEY, clones)


def pre_run(clone: Any) -> None:
    run = getattr(clone, "pre_run", None)
    if run is not None:
        run()


def cleanup(clone: Any) -> None:
    clean = getattr(clone, "cleanup", None)
    if clean is not None:
        clean()


def unload(clone: Any) -> None:
    """ComfyUI unloads this clone's model from its device (weights unpatched), and nothing else
    (`free_memory` on that device, every other loaded model kept)."""
    mm = runtime.model_management()
    loaded = getattr(mm, "current_loaded_models", None)
    free_memory = getattr(mm, "free_memory", None)
    if loaded is None or free_memory is None:
        return
    keep = [m for m in loaded if m.model is not clone]
    if len(keep) != len(loaded):
        free_memory(1e30, clone.load_device, keep_loaded=keep)


def ask_to_free(device: torch.device, nbytes: int) -> None:
    """Let ComfyUI unload what it keeps on a helper `device` (the text encoder) to make room:
    `model_management.free_memory(bytes, device)`. Advisory: a failure is ignored (the caller
    checks the free memory itself)."""
    free_memory = getattr(runtime.model_management(), "free_memory", None)
    if free_memory is not None:
        with contextlib.suppress(Exception):
            free_memory(nbytes, device)


def diffusion_model(clone: Any) -> torch.nn.Module:
    return clone.model.diffusion_model


def container(block: torch.nn.Module) -> Any:
    """The block module's `AttentionTensorContainer` constructor (what a preferred attention
    takes; ComfyUI 0.33.0's attention module and the twin have it), else identity."""
    import sys

    cls = getattr(sys.modules[type(block).__module__], "AttentionTensorContainer", None)
    return (lambda t: t) if cls is None else cls


# ---------------------------------------------------------------- ComfyUI's own CFG split


def apply_cfg_split(patcher: Any, max_gpus: int) -> Any:
    """ComfyUI's own CFG split on a clone of `patcher`: exactly what the MultiGPU CFG Split node
    does (`comfy.multigpu.create_multigpu_deepclones(model, max_gpus, reuse_loaded=True)`: a
    deep clone from the loader's factory on each of core's first `max_gpus - 1` devices other
    than the patcher's, the conds shared among them in core's thread pool). RuntimeError on a
    ComfyUI without it or a loader without a reload factory."""
    module = runtime.multigpu()
    create = getattr(module, "create_multigpu_deepclones", None)
    if create is None:
        raise RuntimeError("this ComfyUI has no MultiGPU CFG Split (comfy.multigpu."
                           "create_multigpu_deepclones)")
    return create(patcher, max_gpus, reuse_loaded=True)


def cfg_split_devices(patcher: Any) -> list[Any]:
    """The GPUs ComfyUI's MultiGPU CFG Split (`MultiGPU_WorkUnits`, comfy/multigpu.py
    `create_multigpu_deepclones`) runs this patcher's conds on, the patcher's own device first;
    empty when it set up no clones (max_gpus 1, one GPU, a ComfyUI without it)."""
    extra = cfg_split_clones(patcher)
    if not extra:
        return []
    return [patcher.load_device, *(m.load_device for m in extra)]


def cfg_split_clones(patcher: Any) -> list[Any]:
    """CFG Split's per-GPU copies of this patcher (its additional models under "multigpu"
    flagged `is_multigpu_base_clone`), in core's device order; empty when it set up none."""
    getter = getattr(patcher, "get_additional_models_with_key", None)
    if not callable(getter):
        return []
    return [m for m in getter(MULTIGPU_CLONES) if getattr(m, "is_multigpu_base_clone", False)]


def select_device_choice(patcher: Any) -> Any | None:
    """The device a core Select Model/CLIP/VAE Device node moved this patcher to (it records
    the loader's own device on the model first, comfy_extras/nodes_multigpu.py), or None when
    no such node chose one."""
    base = getattr(getattr(patcher, "model", None), SELECT_BASE_DEVICE, None)
    device = getattr(patcher, "load_device", None)
    if base is None or device is None or str(base) == str(device):
        return None
    return device
