"""A decoding copy of the video VAE on another device, made from the loaded root (no DynamicVRAM).

The copy is made from the module ComfyUI has loaded on the root GPU, tensor by tensor, so it
holds exactly the weights the root decodes with (patches applied, same dtype; comfy-kitchen
QuantizedTensor weights stay quantized: their int8 data and scales are copied). Only what
decoding runs is copied: the decoder, the post-quant conv and the VAE's own buffers; the encoder
and the quant conv are shared with the original (never run on the copy, no memory). The copy
keeps the original's class, so its windows run the model's own code.

Under DynamicVRAM the weights are VBAR-managed (cast into the root's VBAR at op time): such
modules are never copied here; the helper gets ComfyUI's own clone instead (`comfy_clone`).

`replica_bytes(model)` says what a copy costs; `check_replicable(model)` says why a model
cannot be copied faithfully, in which case the decode stays on one GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..comfy_seam import clones
from ..comfy_seam.h3 import tensor_bytes
from .release import check_splittable

SHARED_CHILDREN = ("encoder", "quant_conv")  # never run when decoding
_ON_THE_FLY = ("weight_function", "bias_function")  # ComfyUI lowvram/patch hooks on a layer
_VBAR = "_v"  # ComfyUI's DynamicVRAM allocation on a layer (ops.cast_bias_weight's VBAR branch)

Copier = Callable[[torch.Tensor, torch.device], torch.Tensor]


class CloneMissing(RuntimeError):
    """This ComfyUI lacks (or refuses) the multi-GPU clone a helper decoder needs; the text
    says which."""


def comfy_clone(patcher: Any, device: torch.device) -> Any:
    """ComfyUI's own per-device copy of the VAE (`comfy_seam.clones.make_clone`, what Select VAE
    Device and MultiGPU CFG Split use): reloaded from the loader's factory into a fresh patcher
    of the same class (`ModelPatcherDynamic` under DynamicVRAM, with its own VBAR on `device`),
    carrying the patches, so the helper never holds tensors shared with, or deep-copied from,
    VBAR-managed modules. Core unloads the source patcher and its clones first: call this
    before the VAE is loaded for a decode, never during one."""
    gap = clones.clone_gap(patcher)
    if gap == clones.NO_CLONES:
        raise CloneMissing("this ComfyUI has no ModelPatcher.deepclone_multigpu (the multi-GPU "
                           "clone of 0.33.0 and the newest files)")
    if gap == clones.NO_FACTORY:
        raise CloneMissing("this VAE's loader registered no reload factory (cached_patcher_init), "
                           "so ComfyUI cannot clone it for another GPU: load it with Load VAE "
                           "(VAELoader) or a checkpoint loader")
    try:
        return clones.make_clone(patcher, device)
    except RuntimeError as exc:  # core's own refusal, in its words
        raise CloneMissing(str(exc)) from exc


def _decoding_modules(model: nn.Module) -> Iterator[nn.Module]:
    yield model
    for name, child in model.named_children():
        if name not in SHARED_CHILDREN:
            yield from child.modules()


def check_replicable(model: nn.Module) -> str | None:
    """None when a faithful decoding copy can be made, else the reason it cannot."""
    reason = check_splittable(model)
    if reason is not None:
        return reason
    for module in _decoding_modules(model):
        if hasattr(module, _VBAR):
            return (f"weights of {type(module).__name__} are managed by DynamicVRAM (a VBAR): "
                    f"the helper needs ComfyUI's own clone, not a copy")
        for attr in _ON_THE_FLY:
            if getattr(module, attr, None):
                return (f"weights of {type(module).__name__} are patched while it runs "
                        f"(ComfyUI lowvram or on-the-fly patches): a copy would lose them")
    return None


def replica_bytes(model: nn.Module) -> int:
    """Bytes of the tensors a decoding copy holds (INT8 weights at their int8 size + scales)."""
    total = 0
    for module in _decoding_modules(model):
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                total += tensor_bytes(tensor)
    return total


def default_copier(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device, copy=True)


def drop_restored_methods(clone: nn.Module, original: nn.Module) -> None:
    """Remove the class methods ComfyUI set back on the original's instance when it removed an
    object patch: they are bound to the original, so on a copy they would run the original."""
    for key, value in list(vars(clone).items()):
        if getattr(value, "__self__", None) is original and \
                getattr(value, "__func__", None) is getattr(type(original), key, None):
            delattr(clone, key)


def _clone_one(module: nn.Module, device: torch.device, move: Copier) -> nn.Module:
    """`module` with its own parameters, buffers and tensor attributes copied to `device`;
    children are left to the caller."""
    clone = copy.copy(module)  # same class, attribute dict copied one level
    for key, value in list(vars(clone).items()):
        if isinstance(value, dict):  # hook dicts etc. must not be shared with the original
            setattr(clone, key, type(value)(value))
        elif isinstance(value, torch.Tensor):  # a plain tensor attribute
            setattr(clone, key, move(value, device))
    # requires_grad as the original's: even under no_grad/inference mode ATen's matmul folds a
    # batched linear differently for a weight that requires grad (measured: fp16 on the CPU,
    # batched tiles of the newest VAE), so a flag changed on the copy changes the last bits
    clone._parameters = {
        k: (None if p is None else nn.Parameter(move(p, device), requires_grad=p.requires_grad))
        for k, p in module._parameters.items()}
    clone._buffers = {k: (None if b is None else move(b, device))
                      for k, b in module._buffers.items()}
    drop_restored_methods(clone, module)
    return clone


def _copy_tree(module: nn.Module, device: torch.device, move: Copier) -> nn.Module:
    clone = _clone_one(module, device, move)
    clone._modules = {name: (None if child is None else _copy_tree(child, device, move))
                      for name, child in module._modules.items()}
    return clone


def make_replica(model: nn.Module, device: torch.device, move: Copier = default_copier
                 ) -> nn.Module:
    """A decoding copy of `model` on `device` (see the module docstring).

    `move(tensor, device)` makes each device copy; the executor passes one that runs on side
    streams so the copy does not queue behind the root's decoding.
    """
    reason = check_replicable(model)
    if reason is not None:
        raise ValueError(f"cannot copy the video VAE to {device}: {reason}")
    top = _clone_one(model, device, move)
    top._modules = {name: (child if name in SHARED_CHILDREN or child is None
                           else _copy_tree(child, device, move))
                    for name, child in model._modules.items()}
    return top
