"""The prefetcher's hooks: every one `apply_block_prefetch` installs, through `comfy_seam`.

On the patcher clone:
- a `("double_block", i)` replace patch per DiT block (chaining one already there): brackets a
  streamed block with the streamer's `begin` / `end`;
- an object patch on `token_refiner.blocks.N.forward` (chaining an earlier one): the refiner
  runs in `extra_conds`, outside any DiT forward, so its first block prepares the streamer (the
  weight-change check) with the root device current, then the refiner blocks stream as the
  prologue of the execution order;
- loader hooks, object patches on every module of every block: `_apply` (what `Module.to`
  calls) leaves a streamed block's tensors in host memory, so ComfyUI's loader moves only the
  resident part; `set_<param>` (ComfyUI's `get_key_weight` looks it up; we add a `None`
  attribute where the module has none, which ComfyUI treats as absent) receives a LoRA-patched
  weight from ComfyUI's own `patch_weight_to_device` and, for a streamed block, puts it into
  the host copy instead of leaving it on the device. Rounding and in-place semantics are
  ComfyUI's own (`stochastic_rounding` with ComfyUI's seed, `copy_to_param`), so the bytes are
  those ComfyUI would have produced;
- a DIFFUSION_MODEL wrapper: prepares the streamer before the block loop, makes the root device
  current, turns ComfyUI's own block prefetch (`prefetch_dynamic_vbars`) off while blocks stream;
- a PREPARE_SAMPLING wrapper (before ComfyUI's loader): decides residency and sets the
  patcher's `model_size()` to what goes on the device;
- callbacks ON_LOAD (notes ComfyUI's own lowvram streaming), ON_DETACH (frees slots, unpins),
  ON_APPLY_HOOKS (weight hooks patch in place: slot copies are stale).
The `BlockPrefetch` is the state installed with them: `protocol.find(patcher, "prefetch")`
answers it (`get_block_prefetch`, the sequence mode), and the block patches are marked
transparent (`protocol.link_info`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comfy_seam import h3 as seam_h3
from ..comfy_seam import loader, names, protocol
from ..comfy_seam.devices import device_context
from .apply import BlockPrefetch

_UNSET = object()
_MATH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def install(patcher: Any, prefetch: BlockPrefetch) -> None:
    # transparent: a block patch only brackets the block with weight copies and never reads the
    # residual stream, so the sequence mode keeps its rows split across it
    hooks = [protocol.block_patch(i, lambda previous, i=i: _block_patch(
        prefetch, f"blocks.{i}", previous), transparent=True) for i in range(prefetch.blocks)]
    for j in range(prefetch.refiner_blocks):
        key = f"diffusion_model.token_refiner.blocks.{j}.forward"
        hooks.append(protocol.object_patch(key, _refiner_forward(
            prefetch, f"token_refiner.blocks.{j}", patcher.get_model_object(key), first=j == 0)))
    for block_id in prefetch.block_ids:
        hooks += _loader_patches(patcher, prefetch, block_id)
    hooks += [
        protocol.wrapper(names.DIFFUSION_MODEL, _diffusion_wrapper(prefetch)),
        protocol.wrapper(names.PREPARE_SAMPLING, _prepare_wrapper(prefetch)),
        protocol.callback(names.ON_LOAD, lambda p, *_: prefetch.on_load(p)),
        protocol.callback(names.ON_DETACH, lambda p, unpatch_all: prefetch.on_detach(
            p, unpatch_all)),
        protocol.callback(names.ON_APPLY_HOOKS, lambda p, hooks: _invalidate(prefetch)),
    ]
    protocol.install(patcher, "prefetch", *hooks, state=prefetch)


def _invalidate(prefetch: BlockPrefetch) -> None:
    if prefetch.streamer is not None:
        prefetch.streamer.invalidate()


def _device_current(prefetch: BlockPrefetch):
    # ComfyUI's kernels (comfy-kitchen's RoPE, current_stream) use the current device: a DiT on
    # cuda:1 must run, and its blocks be prepared, with cuda:1 current
    return device_context(prefetch.device)


# ---------------------------------------------------------------------- running the blocks
def _block_patch(prefetch: BlockPrefetch, block_id: str, previous: Callable | None) -> Callable:
    def patch(args: dict, extra: dict) -> dict:
        if previous is not None:
            return prefetch.run(block_id, lambda: previous(args, extra))
        return prefetch.run(block_id, lambda: extra["original_block"](args))

    return patch


def _refiner_forward(prefetch: BlockPrefetch, block_id: str, original: Callable,
                     first: bool) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with _device_current(prefetch):
            if first:
                # upstream runs the refiner in extra_conds, after ComfyUI loaded (and maybe
                # re-patched) the weights and before any DiT forward: check them here
                prefetch.prepare()
            return prefetch.run(block_id, lambda: original(*args, **kwargs))

    return forward


def _diffusion_wrapper(prefetch: BlockPrefetch) -> Callable:
    def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
        with _device_current(prefetch):
            prefetch.prepare()
            options = seam_h3.forward_options(args, kwargs)
            if prefetch.streamed_ids and options is not None:
                # ComfyUI writes this flag on a copy of the options per call: switching it off
                # here keeps its DynamicVRAM block prefetch from staging our blocks a second time
                options[names.PREFETCH_DYNAMIC_VBARS] = False
            return executor(*args, **kwargs)

    return wrapper


def _prepare_wrapper(prefetch: BlockPrefetch) -> Callable:
    def wrapper(executor: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
        with _device_current(prefetch):
            prefetch.ensure_resolved(model)
        if prefetch.streamed_ids:
            # load_models_gpu frees, and partially_load compares with, model_size(): make it
            # what really goes on the device, so the loader neither evicts other models for
            # nor falls back to a lowvram load because of blocks that never go there
            loader.set_load_size(model, prefetch.device_footprint_bytes())
        return executor(model, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------- loader hooks
def _loader_patches(patcher: Any, prefetch: BlockPrefetch, block_id: str) -> list:
    hooks = []
    block = prefetch.module(block_id)
    for path, module in block.named_modules():
        prefix = f"diffusion_model.{block_id}" + (f".{path}" if path else "")
        if not path or module._parameters or module._buffers:
            key = loader.apply_key(prefix)
            hooks.append(protocol.object_patch(key, _apply_patch(
                prefetch, block_id, module, patcher.get_model_object(key))))
        for name, param in module._parameters.items():
            if param is None:
                continue
            # the attribute has to exist for an object patch to replace it
            loader.ensure_setter_slot(module, name)
            key = loader.setter_key(prefix, name)
            hooks.append(protocol.object_patch(key, _set_patch(
                prefetch, block_id, module, name, patcher.get_model_object(key))))
    return hooks


def _apply_patch(prefetch: BlockPrefetch, block_id: str, module: torch.nn.Module,
                 original: Callable) -> Callable:
    def _apply(fn: Callable, recurse: bool = True) -> torch.nn.Module:
        if prefetch.is_streamed(block_id):
            return module  # a streamed block's tensors stay in host memory
        return original(fn, recurse)

    return _apply


def _set_patch(prefetch: BlockPrefetch, block_id: str, owner: torch.nn.Module, name: str,
               previous: Callable | None) -> Callable:
    def set_param(out: torch.Tensor, inplace_update: Any = _UNSET, seed: Any = None,
                  return_weight: bool = False, **kwargs: Any) -> Any:
        current = getattr(owner, name)
        if inplace_update is _UNSET and return_weight:
            # LowVramPatch computing a weight on the fly: return what ComfyUI returns without
            # a setter (its own rounding only for a non-math weight dtype)
            if previous is not None:
                return previous(out, seed=seed, return_weight=True, **kwargs)
            if out.dtype == torch.float32 and current.dtype not in _MATH_DTYPES:
                return _round(out, current.dtype, seed)
            return out
        inplace = bool(inplace_update) if inplace_update is not _UNSET else False
        if previous is not None:
            value = previous(out, inplace_update=inplace, seed=seed, return_weight=True, **kwargs)
        else:
            value = _round(out, current.dtype, seed)  # patch_weight_to_device without a setter
        if return_weight:
            return value
        if inplace:
            current.data.copy_(value)  # comfy.utils.copy_to_param
            if prefetch.streamer is not None:
                prefetch.streamer.invalidate()
            return None
        prefetch.place_weight(block_id, owner, name, value)
        return None

    return set_param


def _round(value: torch.Tensor, dtype: torch.dtype, seed: Any) -> torch.Tensor:
    return loader.stochastic_round(value, dtype, seed)
