"""`apply_activation_chunking`: clone the patcher, patch each DiT block's forward method."""

from __future__ import annotations

from typing import Any

import torch

from ..guard.device import guard_diffusion_model
from .block import ChunkedBlockForward, ChunkingReport, block_floors, block_linears
from .config import ChunkingConfig
from .h3_ops import block_adapter_ranks

_BLOCK_PARTS = ("norm1", "norm2", "adaln_proj", "attn.qkv_proj", "attn.out_proj", "attn.q_norm",
                "attn.k_norm", "mlp.fc1", "mlp.fc2")


def _has(obj: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def apply_activation_chunking(model_patcher: Any, config: ChunkingConfig) -> Any:
    """A clone of `model_patcher` whose H3 DiT blocks run FFN/QKV row chunks and head groups.

    Installs `diffusion_model.blocks.N.forward` object patches (methods, never modules, so
    weight and LoRA keys are untouched) through the patcher's public `add_object_patch`, and the
    DiT device guard (`nodes.device_guard`); works on ComfyUI's ModelPatcher and on the twin's
    `TwinPatcher`. Attention still goes through the H3
    module's `optimized_attention`, so attention overrides (Dual-Sage) apply per head group.
    Everything is checked before the clone is patched: a `ValueError` names the problem.
    """
    if not isinstance(config, ChunkingConfig):
        raise ValueError(f"config must be a ChunkingConfig, got {type(config).__name__}; build "
                         f"one with ChunkingConfig(...) or ChunkingConfig.from_strings(...)")
    patcher = model_patcher.clone()
    diffusion_model = patcher.get_model_object("diffusion_model")
    blocks = getattr(diffusion_model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError(f"{type(diffusion_model).__name__} has no DiT blocks; activation "
                         f"chunking needs a MiniMax H3 model")
    indices = range(len(blocks)) if config.blocks is None else config.blocks
    for index in indices:
        if index >= len(blocks):
            raise ValueError(f"block index {index} is out of range: the model has {len(blocks)} "
                             f"blocks (0..{len(blocks) - 1})")
        missing = [part for part in _BLOCK_PARTS if not _has(blocks[index], part)]
        if missing:
            raise ValueError(f"block {index} ({type(blocks[index]).__name__}) lacks "
                             f"{', '.join(missing)}: activation chunking needs a MiniMax H3 DiT")
        key = f"diffusion_model.blocks.{index}.forward"
        existing = getattr(patcher, "object_patches", {}).get(key)
        if existing is not None and not isinstance(existing, ChunkedBlockForward):
            raise ValueError(f"{key} is already patched by {type(existing).__name__}; chunking "
                             f"replaces the block forward, so other features must wrap blocks "
                             f"through block-replace patches or wrappers instead")
    heads = getattr(getattr(blocks[0], "attn", None), "heads", None)
    heads = heads if isinstance(heads, int) else None
    report = ChunkingReport(config, len(blocks), heads, _apply_time_floors(
        patcher, [blocks[i] for i in indices]))
    if config.active_with(heads):
        for index in indices:
            patcher.add_object_patch(f"diffusion_model.blocks.{index}.forward",
                                     ChunkedBlockForward(blocks[index], config, report))
    options = patcher.model_options.setdefault("transformer_options", {})
    status = {**options.get("h3_multigpu", {}), "chunking": report.line()}
    options["h3_multigpu"] = status
    # the block forwards rewrite the line once they know what ran (adapters ComfyUI injects
    # at load, "auto"'s choices): in this patcher's options, and in the copy of each run
    report.sinks.append(status)
    # the chunked blocks call comfy-kitchen and the bypass adapters like the plain ones: they
    # must run with the DiT's GPU current, whatever ComfyUI left current
    return guard_diffusion_model(patcher)


def _apply_time_floors(patcher: Any, blocks: list[torch.nn.Module]):
    """The row floors the blocks have now, on the patcher's load device: the adapters injected
    on the modules at this moment (the twin's; ComfyUI injects its bypass adapters at load,
    and the forwards look again), every block's ranks together."""
    from . import sizing

    if not blocks:
        return sizing.RowFloors()
    first = blocks[0]
    linears = block_linears(first)
    ranks: dict[str, tuple[int, ...]] = {name: () for name in linears}
    for block in blocks:
        for name, found in block_adapter_ranks(block, block_linears(block)).items():
            ranks[name] = tuple(sorted({*ranks[name], *found}))
    device = torch.device(getattr(patcher, "load_device", None) or "cpu")
    weight = getattr(first.attn.qkv_proj, "weight", None)
    dtype = weight.dtype if getattr(weight, "is_floating_point", lambda: False)() and \
        weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    return block_floors(linears, device, dtype, ranks)
