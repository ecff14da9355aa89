"""One device guard for the H3 job: the DiT, text encoder and VAEs run with their GPU current.

ComfyUI leaves one GPU current (cuda:0) while a model placed on another (cuda:1) runs. Most torch
ops follow their tensors, but some work goes to the current device: comfy-kitchen exports tensors
through DLPack on the current stream (`BufferError: Can't export tensors on a different CUDA
device index`, the unpatched H3 DiT on cuda:1), Triton launches on it, and ComfyUI's bypass
(on-activation) LoRA moves its adapter weights to `model_management.get_torch_device()`, the
current device, when the patcher injects them during loading.

Seams, all public ComfyUI hooks, installed through `comfy_seam.protocol` (feature "guard",
outermost in its ORDER):
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

`device_context` (comfy_seam.devices) is the one place that makes a device current (tests
replace this module's name for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..comfy_seam import names, protocol
from ..comfy_seam.devices import device_context
from ..comfy_seam.h3 import sampled_patcher

TEXT_ENCODER_METHODS = ("encode_token_weights",)
VAE_METHODS = ("encode", "decode")


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
    """OUTER_SAMPLE wrapper: the sampled patcher's load device is current for the whole run.
    First, before ComfyUI loads anything, a pack feature that cannot run beside ComfyUI's
    MultiGPU CFG Split placed after the pack's node is refused (`guard.composition`)."""
    from .composition import check_cfg_split

    patcher = sampled_patcher(executor)
    if patcher is not None:
        check_cfg_split(patcher)
    device = getattr(patcher, "load_device", None)
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


_WRAPPERS: dict[str, Callable] = {names.OUTER_SAMPLE: outer_sample_guard,
                                  names.DIFFUSION_MODEL: diffusion_model_guard}


def has_device_guard(patcher: Any) -> bool:
    return all(protocol.wrappers_of(patcher, kind, "guard") for kind in _WRAPPERS)


def guard_diffusion_model(patcher: Any) -> Any:
    """Install the DiT device guard on `patcher` (in place; pass a clone) and return it.

    Idempotent: a patcher that already has it (a feature installed it before) is unchanged.
    The seam orders it outermost, so it encloses every other wrapper; the out-of-memory guard
    (`guard.oom`) comes right inside it on OUTER_SAMPLE.
    """
    from .oom import outer_sample_oom_guard

    if not has_device_guard(patcher):
        protocol.install(patcher, "guard", *(protocol.wrapper(kind, fn)
                                             for kind, fn in _WRAPPERS.items()))
    if not protocol.wrappers_of(patcher, names.OUTER_SAMPLE, "oom"):
        # inside the device guard, outside every feature's wrapper (the seam's ORDER)
        protocol.install(patcher, "oom", protocol.wrapper(names.OUTER_SAMPLE,
                                                          outer_sample_oom_guard))
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
        protocol.install(patcher, "guard",
                         protocol.object_patch(name, DeviceGuardedMethod(current, device)))
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
