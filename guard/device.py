"""One device guard for the H3 job: the DiT, text encoder and VAEs run with their GPU current.

ComfyUI leaves one GPU current (cuda:0) while a model placed on another (cuda:1) runs. Most torch
ops follow their tensors, but some work goes to the current device: comfy-kitchen exports tensors
through DLPack on the current stream (`BufferError: Can't export tensors on a different CUDA
device index`, the unpatched H3 DiT on cuda:1), Triton launches on it, and ComfyUI's bypass
(on-activation) LoRA moves its adapter weights to `model_management.get_torch_device()`, the
current device, when the patcher injects them during loading.

Seams, all public ComfyUI hooks:
- DiT: an OUTER_SAMPLE wrapper keeps the patcher's load device current for the whole sampling
  run (loading and bypass injection, the token refiner that runs in `extra_conds`, every step),
  and a DIFFUSION_MODEL wrapper does the same for each DiT forward from the device of its input
  (a forward called outside a sampler is covered too). Both go first in the patcher's wrapper
  lists, so every other wrapper runs inside them; installing twice is a no-op.
- text encoder: an object patch on the CLIP patcher's `encode_token_weights`.
- VAE: object patches on the first stage model's `encode` and `decode`.
- out of memory: an OUTER_SAMPLE wrapper right inside the device guard (`guard.oom`) frees the
  pack's buffers and explains the error (installed with the guard, once).
Object patches wrap whatever the patcher already resolves (another pack's patch included).

`device_context(device)` is the one place that makes a device current (tests replace it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

GUARD_KEY = "h3_multigpu.device_guard"
# ComfyUI's WrappersMP names (comfy.patcher_extension), spelled out so this imports without it
OUTER_SAMPLE = "outer_sample"
DIFFUSION_MODEL = "diffusion_model"
TEXT_ENCODER_METHODS = ("encode_token_weights",)
VAE_METHODS = ("encode", "decode")


def device_context(device: Any) -> contextlib.AbstractContextManager:
    """Make `device` current while the block runs (CUDA/ROCm and XPU; nothing elsewhere)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    xpu = getattr(torch, "xpu", None)
    if device.type == "xpu" and device.index is not None and xpu is not None:
        return xpu.device(device)
    return contextlib.nullcontext()


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def input_device(args: tuple, kwargs: dict) -> Any | None:
    """Device of the first tensor among the call's arguments (H3 passes [video, audio])."""
    for value in (*args, *kwargs.values()):
        for tensor in _tensors(value):
            return tensor.device
    return None


def outer_sample_guard(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: the sampled patcher's load device is current for the whole run."""
    device = getattr(getattr(executor.class_obj, "model_patcher", None), "load_device", None)
    if device is None:
        return executor(*args, **kwargs)
    with device_context(device):
        return executor(*args, **kwargs)


def diffusion_model_guard(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: the forward's input device is current while it runs."""
    device = input_device(args, kwargs)
    if device is None:
        return executor(*args, **kwargs)
    with device_context(device):
        return executor(*args, **kwargs)


_WRAPPERS: dict[str, Callable] = {OUTER_SAMPLE: outer_sample_guard,
                                  DIFFUSION_MODEL: diffusion_model_guard}


def _wrapper_table(patcher: Any) -> dict[str, dict[str, list]]:
    """The patcher's wrappers by type: ModelPatcher.wrappers, or the twin's transformer_options."""
    table = getattr(patcher, "wrappers", None)
    if isinstance(table, dict):
        return table
    options = patcher.model_options.setdefault("transformer_options", {})
    return options.setdefault("wrappers", {})


def has_device_guard(patcher: Any) -> bool:
    table = _wrapper_table(patcher)
    return all(table.get(kind, {}).get(GUARD_KEY) for kind in _WRAPPERS)


def guard_diffusion_model(patcher: Any) -> Any:
    """Install the DiT device guard on `patcher` (in place; pass a clone) and return it.

    Idempotent: a patcher that already has it (a feature installed it before) is unchanged.
    The guard is moved to the front of each wrapper list so it encloses every other wrapper.
    """
    from .oom import OOM_GUARD_KEY, outer_sample_oom_guard

    table = _wrapper_table(patcher)
    for kind, fn in _WRAPPERS.items():
        by_key = table.get(kind, {})
        mine = by_key.get(GUARD_KEY) or [fn]
        front = {GUARD_KEY: mine}
        if kind == OUTER_SAMPLE:  # inside the device guard, outside every feature's wrapper
            front[OOM_GUARD_KEY] = by_key.get(OOM_GUARD_KEY) or [outer_sample_oom_guard]
        table[kind] = {**front, **{k: v for k, v in by_key.items() if k not in front}}
    return patcher


class DeviceGuardedMethod:
    """`original(*args, **kwargs)` with `device` current: an object patch on a model method."""

    def __init__(self, original: Callable, device: Any):
        self.original = original
        self.device = device

    def __call__(self, *args, **kwargs):
        with device_context(self.device):
            return self.original(*args, **kwargs)


def _guard_methods(patcher: Any, names: tuple[str, ...], device: Any) -> int:
    """Object-patch each existing method `name` of patcher.model; returns how many it guards."""
    guarded = 0
    for name in names:
        try:
            current = patcher.get_model_object(name)
        except AttributeError:
            continue  # this model has no such method (an audio VAE without encode, ...)
        if isinstance(current, DeviceGuardedMethod):
            if str(current.device) == str(device):
                guarded += 1
                continue
            current = current.original  # placed again on another GPU: re-target, never nest
        if not callable(current):
            continue
        patcher.add_object_patch(name, DeviceGuardedMethod(current, device))
        guarded += 1
    return guarded


def guard_text_encoder(clip: Any, device: Any = None) -> int:
    """Guard a CLIP's encode on `device` (default its patcher's load device), in place."""
    patcher = clip.patcher
    return _guard_methods(patcher, TEXT_ENCODER_METHODS, device or patcher.load_device)


def guard_vae(vae: Any, device: Any = None) -> int:
    """Guard a VAE's first-stage encode/decode on `device` (default its patcher's), in place."""
    patcher = vae.patcher
    return _guard_methods(patcher, VAE_METHODS, device or patcher.load_device)
