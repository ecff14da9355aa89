"""A small stand-in for ComfyUI's ModelPatcher, enough to run every `apply_*` on the twin.

It implements the ModelPatcher API the seam (`comfy_seam.protocol`) calls, with ComfyUI's
semantics, so the seam has one code path for both: `clone()` shares the model and copies
`model_options`, `object_patches`, `callbacks`, `wrappers` and `attachments` (so patches on a
clone do not leak back), `model_options["transformer_options"]`, `set_model_patch_replace`,
`add_object_patch` / `object_patches` (applied while the model runs, restored after),
`add_wrapper_with_key` / `remove_wrappers_with_key` / `wrappers`, `add_callback_with_key` /
`remove_callbacks_with_key` / `callbacks` (recorded; the twin has no load lifecycle that would
call them), `get_model_object`, `load_device` / `offload_device`, and
`set_model_optimized_attention`-style override install.
On real ComfyUI the same `apply_*` functions receive a real ModelPatcher instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


class TwinBaseModel(torch.nn.Module):
    """Mirrors ComfyUI's BaseModel: the DiT lives at `.diffusion_model`."""

    def __init__(self, diffusion_model: torch.nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model


class TwinPatcher:
    def __init__(self, diffusion_model: torch.nn.Module, load_device=None, offload_device=None):
        self.model = TwinBaseModel(diffusion_model)
        first = next(diffusion_model.parameters())
        self.load_device = torch.device(load_device) if load_device is not None else first.device
        self.offload_device = torch.device(offload_device or "cpu")
        self.model_options: dict[str, Any] = {"transformer_options": {}}
        self.object_patches: dict[str, Any] = {}
        self.attachments: dict[str, Any] = {}
        self.callbacks: dict[str, dict[str, list[Callable]]] = {}

    # ---------------------------------------------------------------- ComfyUI's surface
    def clone(self) -> TwinPatcher:
        n = TwinPatcher.__new__(TwinPatcher)
        n.model = self.model
        n.load_device = self.load_device
        n.offload_device = self.offload_device
        n.model_options = _copy_options(self.model_options)
        n.object_patches = dict(self.object_patches)
        n.attachments = dict(self.attachments)
        n.callbacks = {kind: {key: list(fns) for key, fns in by_key.items()}
                       for kind, by_key in self.callbacks.items()}
        return n

    @property
    def wrappers(self) -> dict[str, dict[str, list[Callable]]]:
        """{wrapper type: {key: [wrapper, ...]}}, ComfyUI's `ModelPatcher.wrappers`. Kept where
        the twin's DiT reads them, in transformer_options["wrappers"]: the copy ComfyUI makes
        there per sampling run (clone copies it with model_options)."""
        return self.model_options["transformer_options"].setdefault("wrappers", {})

    def get_model_object(self, name: str) -> Any:
        if name in self.object_patches:
            return self.object_patches[name]
        obj: Any = self.model
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def add_object_patch(self, name: str, obj: Any) -> None:
        self.object_patches[name] = obj

    def set_model_patch_replace(self, patch: Callable, name: str, block_name: str,
                                number: int, transformer_index: int | None = None) -> None:
        to = self.model_options["transformer_options"]
        key = (block_name, number) if transformer_index is None else (
            block_name, number, transformer_index)
        to.setdefault("patches_replace", {}).setdefault(name, {})[key] = patch

    def add_wrapper_with_key(self, wrapper_type: str, key: str, fn: Callable) -> None:
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wrapper_type: str, key: str) -> None:
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def add_callback_with_key(self, call_type: str, key: str, fn: Callable) -> None:
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(fn)

    def remove_callbacks_with_key(self, call_type: str, key: str) -> None:
        self.callbacks.get(call_type, {}).pop(key, None)

    def set_model_optimized_attention(self, fn: Callable) -> None:
        self.model_options["transformer_options"]["optimized_attention_override"] = fn

    # ---------------------------------------------------------------- running
    def conditioning(self, x, context, **kwargs) -> dict:
        """The per-sampling-run keyword arguments ComfyUI's `extra_conds` would give the forward
        (refined text, payload with layout and audio carry): see `make_conditioning`."""
        from .factory import make_conditioning

        return make_conditioning(self.model.diffusion_model, context, x, **kwargs)

    def apply_model(self, x, timestep, context, **kwargs):
        """One DiT forward with this clone's options and object patches in force."""
        transformer_options = _copy_options(self.model_options)["transformer_options"]
        saved = []
        try:
            for name, obj in self.object_patches.items():
                owner_path, _, attr = name.rpartition(".")
                owner = self.model
                for part in owner_path.split("."):
                    owner = getattr(owner, part)
                saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
                setattr(owner, attr, obj)
            return self.model.diffusion_model(x, timestep, context,
                                              transformer_options=transformer_options, **kwargs)
        finally:
            for owner, attr, old in reversed(saved):
                if old is _MISSING:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, old)


_MISSING = object()


def _copy_options(options: dict) -> dict:
    """ComfyUI copies nested dicts of model_options on clone but shares the callables."""
    out: dict = {}
    for k, v in options.items():
        out[k] = _copy_options(v) if isinstance(v, dict) else (
            list(v) if isinstance(v, list) else copy.copy(v) if isinstance(v, set) else v)
    return out
