"""Carry a placement out inside ComfyUI, through ComfyUI's own device selection.

Order of preference for MODEL, CLIP and VAE:
1. core `SelectModelDevice` / `SelectCLIPDevice` / `SelectVAEDevice` (comfy_extras.nodes_multigpu,
   0.33.0 and newest): we call the node's own `execute`, so its rules apply unchanged (fresh
   weights through `deepclone_multigpu`, compute dtype forced to one the GPU supports,
   CFG-split clones pruned, `register_load_device` for a DynamicVRAM patcher);
2. ComfyUI's multi-GPU clone (`comfy_seam.clones.retarget`: the pack's one clone path) where
   the patcher has it;
3. otherwise (older ComfyUI, a loader without a reload factory) a clone whose `load_device` is
   the target, registered with DynamicVRAM where the patcher is dynamic (`clones.retarget`
   too), said so in the status.
A LATENT_UPSCALE_MODEL has no core device choice: it is a wrapper with a `.patcher` (Hunyuan and
H3 style, the pack's loader registers a reload factory so 2. applies) or a ModelPatcher itself
(LTX style); both are retargeted with 2./3.

Every placed object also gets the device guard (`device_guard.py`): the DiT samples, the text
encoder encodes and the VAE codes with their own GPU current, never the one ComfyUI left current.
Every function returns (object, note) and never raises for a device that is missing: the
note says what was asked and where the object stays. ComfyUI is reached through the seam only.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..comfy_seam import clones, core_nodes, models
from ..guard.device import guard_diffusion_model, guard_text_encoder, guard_vae
from .devices import device_option

log = logging.getLogger("h3_multigpu")


def torch_device(index: int):
    """ComfyUI's torch.device for gpu:index (cuda:index on CUDA and ROCm)."""
    found = models.resolve_gpu_option(device_option(index))
    if found is not None:
        return found
    import torch

    return torch.device("cuda", index)


def _core_node(name: str):
    """A core multi-GPU node class, or None on a ComfyUI without them (or without ComfyUI)."""
    return core_nodes.multigpu_node(name)


def _first(output: Any) -> Any:
    """First result of a V3 NodeOutput (or a V1 tuple)."""
    args = getattr(output, "args", output)
    return args[0]


def _same_device(a, b) -> bool:
    return a is not None and b is not None and str(a) == str(b)


def retarget_patcher(patcher: Any, target) -> tuple[Any, str]:
    """A patcher whose load device is `target`; the input patcher is left untouched."""
    if _same_device(getattr(patcher, "load_device", None), target):
        return patcher.clone(), "already there"
    return clones.retarget(patcher, target)


def _before(patcher: Any, index: int) -> str:
    """Who placed the object before the pack: a core Select*Device node's choice, said where
    the pack's placement differs (only the pack's copy loads: ComfyUI loads when it runs)."""
    chosen, who = clones.select_device_choice(patcher), "a Select Device node"
    if chosen is None:
        chosen, who = _loader_choice(patcher), "the loader's device input (or a ComfyUI flag)"
    if chosen is None or _same_device(chosen, torch_device(index)):
        return ""
    return (f"; {who} chose {chosen}, the pack's placement overrides it (set the pack's "
            f"devices, or that choice, to keep one)")


def _loader_choice(patcher: Any) -> Any | None:
    """The patcher's device where it is not ComfyUI's default one: a loader's `device` input
    (CLIPLoader's "cpu", newer core's UNET/VAE loaders) chose it; None outside ComfyUI."""
    device, default = getattr(patcher, "load_device", None), models.default_device()
    if device is None or default is None or _same_device(device, default):
        return None
    return device


def _cfg_split(patcher: Any) -> str:
    """ComfyUI's MultiGPU CFG Split beside the placed DiT: where its copies run (core places
    them; the pack's placement moves only its own copy)."""
    devices = clones.cfg_split_devices(patcher)
    if len(devices) < 2:
        return ""
    return (f"; MultiGPU CFG Split (ComfyUI) runs copies on "
            f"{', '.join(str(d) for d in devices[1:])}")


def _checked(obj_device, index: int, what: str, how: str, before: str = "") -> str:
    if _same_device(obj_device, torch_device(index)):
        return f"{what} -> {device_option(index)} ({how}){before}"
    return (f"{what}: asked for {device_option(index)} but it stays on {obj_device} ({how}); "
            f"check the ComfyUI log")


def place_model(model: Any, index: int) -> tuple[Any, str]:
    """The DiT's ModelPatcher on gpu:index."""
    before = _before(model, index)
    core = _core_node("SelectModelDeviceNode")
    if core is not None:
        placed, how = _first(core.execute(model, device_option(index))), "core Select Model Device"
    else:
        placed, how = retarget_patcher(model, torch_device(index))
    if placed is model:  # never add the guard to the caller's patcher
        placed = model.clone()
    guard_diffusion_model(placed)
    return placed, _checked(getattr(placed, "load_device", None), index, "DiT", how,
                            before + _cfg_split(placed))


def place_clip(clip: Any, index: int) -> tuple[Any, str]:
    """The text encoder (a CLIP wrapper around a patcher) on gpu:index."""
    before = _before(clip.patcher, index)
    core = _core_node("SelectCLIPDeviceNode")
    if core is not None:
        placed, how = _first(core.execute(clip, device_option(index))), "core Select CLIP Device"
    else:
        placed = clip.clone()
        placed.patcher, how = retarget_patcher(clip.patcher, torch_device(index))
    if placed is clip or placed.patcher is clip.patcher:
        placed = clip.clone() if placed is clip else placed
        placed.patcher = clip.patcher.clone()
    guard_text_encoder(placed)
    return placed, _checked(placed.patcher.load_device, index, "text encoder", how, before)


def place_vae(vae: Any, index: int, what: str = "video VAE") -> tuple[Any, str]:
    """A VAE (video or audio) on gpu:index."""
    before = _before(vae.patcher, index)
    core = _core_node("SelectVAEDeviceNode")
    if core is not None:
        placed, how = _first(core.execute(vae, device_option(index))), "core Select VAE Device"
    else:
        target = torch_device(index)
        placed = copy.copy(vae)  # VAE has no clone(); never mutate the loader's object
        placed.patcher, how = retarget_patcher(vae.patcher, target)
        # The VAE reads `device` for its inputs and `first_stage_model` for its weights.
        placed.first_stage_model = placed.patcher.model
        placed.device = target
    if placed is vae or placed.patcher is vae.patcher:
        placed = copy.copy(vae) if placed is vae else placed
        placed.patcher = vae.patcher.clone()
    guard_vae(placed)
    return placed, _checked(placed.patcher.load_device, index, what, how, before)


def place_upscaler(upscaler: Any, index: int) -> tuple[Any, str]:
    """A LATENT_UPSCALE_MODEL on gpu:index (core has no device choice for it)."""
    target = torch_device(index)
    if hasattr(upscaler, "patcher"):
        placed = copy.copy(upscaler)
        placed.patcher, how = retarget_patcher(upscaler.patcher, target)
        # Wrappers move their input to `load_device` (or `device`) before the forward; one
        # that reads it from its patcher (a property, the pack's) follows the patcher already
        for attr in ("load_device", "device"):
            if hasattr(placed, attr) and not isinstance(getattr(type(placed), attr, None),
                                                        property):
                setattr(placed, attr, target)
        return placed, _checked(placed.patcher.load_device, index, "latent upscaler", how)
    if hasattr(upscaler, "load_device") and hasattr(upscaler, "clone"):
        placed, how = retarget_patcher(upscaler, target)
        return placed, _checked(placed.load_device, index, "latent upscaler", how)
    return upscaler, (f"latent upscaler: a {type(upscaler).__name__} has no device to set; it "
                      f"runs where its loader put it")


def release_text_encoder(clip: Any) -> str:
    """Unload the text encoder's weights from its GPU (`comfy_seam.models.release`: every
    other loaded model stays); ComfyUI reloads it by itself when a new prompt needs encoding."""
    try:
        released = models.release(clip.patcher)
    except models.ComfyUIMissing:
        return "text encoder release skipped: ComfyUI's model management is not importable"
    if released is None:
        return "text encoder: not resident on a GPU, nothing to release"
    device, unloaded = released
    return f"text encoder released from {device} ({unloaded} model(s) unloaded)"
