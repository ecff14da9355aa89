"""The ComfyUI loader internals the block prefetcher hooks (legacy loader; DynamicVRAM streams
by itself and the prefetcher stands aside). Each names what it relies on; `internals` lists
them with the releases they were checked on."""

from __future__ import annotations

from typing import Any


def apply_key(prefix: str) -> str:
    """The object-patch name of a module's `_apply`. ComfyUI internal: `Module.to` (what the
    loader's `model.to(device)` and `module.to(...)` calls run) goes through `_apply`; an object
    patch on it is set by `ModelPatcher.patch_model` like any method patch."""
    return f"{prefix}._apply"


def setter_key(prefix: str, name: str) -> str:
    """The object-patch name of a parameter's setter. ComfyUI internal: `get_key_weight` looks
    up `set_<param>` on the owning module, and `patch_weight_to_device` (and LowVramPatch with
    `return_weight=True`) hands it the patched weight instead of writing the parameter."""
    return f"{prefix}.set_{name}"


def ensure_setter_slot(module: Any, name: str) -> None:
    """Give `module` a `set_<name>` attribute (None) so an object patch can replace it. ComfyUI
    internal: a None `set_<param>` is treated as no setter at all (0.33.0, newest files)."""
    if not hasattr(module, f"set_{name}"):
        setattr(module, f"set_{name}", None)


def set_load_size(model: Any, nbytes: int) -> None:
    """Make the loader see `nbytes` as the patcher's model size (the PREPARE_SAMPLING wrapper's
    `model`). ComfyUI internal: `ModelPatcher.size`, which `model_size()` returns once set and
    `load_models_gpu` / `partially_load` compare with free memory."""
    if hasattr(model, "size"):
        model.size = nbytes


def stochastic_round(value: Any, dtype: Any, seed: Any) -> Any:
    """ComfyUI's rounding of a patched weight to the stored dtype (`comfy.float.
    stochastic_rounding` with the loader's seed): what `patch_weight_to_device` writes."""
    import comfy.float  # only ever called by ComfyUI's own loader

    return comfy.float.stochastic_rounding(value, dtype, seed=seed)
