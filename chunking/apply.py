"""`apply_activation_chunking`: clone the patcher; upstream's block runs on row chunks."""

from __future__ import annotations

from typing import Any

import torch

from ..comfy_seam import names, protocol
from ..common.formats import block_adapter_ranks, block_floors, block_linears
from .config import ChunkingConfig
from .report import ChunkingReport
from .wrappers import WRAPPED, BlockChunker, ChunkingRuntime, HeadGroups

_BLOCK_PARTS = (*WRAPPED, "attn.q_norm", "attn.k_norm", "mlp.fc1", "mlp.fc2")


def _has(obj: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def apply_activation_chunking(model_patcher: Any, config: ChunkingConfig) -> Any:
    """A clone of `model_patcher` whose H3 DiT blocks run their QKV/out projections and MLP on
    row chunks and their attention in head groups (`chunking.wrappers`).

    Installs through the seam (`comfy_seam.protocol`, state: the `ChunkingRuntime`): a
    DIFFUSION_MODEL wrapper that wraps the chunked blocks' `attn.qkv_proj`, `attn.out_proj` and
    `mlp` forwards for each DiT forward, and the head-group attention override (chained with any
    other) when head groups are asked for; the blocks' own forward, weights and state-dict keys
    are untouched. Works on ComfyUI's ModelPatcher and on the twin's `TwinPatcher`. Everything
    is checked before the clone is patched: a `ValueError` names the problem.

    Upstream's modules call comfy-kitchen and the bypass adapters, which must run with the DiT's
    GPU current: the DiT device guard (`guard.device`) does that, installed by whoever composes
    the features (`nodes.features.apply_feature` on every feature's clone), not by a feature.
    """
    if not isinstance(config, ChunkingConfig):
        raise ValueError(f"config must be a ChunkingConfig, got {type(config).__name__}; build "
                         f"one with ChunkingConfig(...) or ChunkingConfig.from_strings(...)")
    diffusion_model = model_patcher.get_model_object("diffusion_model")
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
    # applied again (a second node, new settings): the new settings replace the old ones
    patcher = protocol.remove(model_patcher, "chunking") if protocol.has(
        model_patcher, "chunking") else model_patcher.clone()
    heads = getattr(getattr(blocks[0], "attn", None), "heads", None)
    heads = heads if isinstance(heads, int) else None
    report = ChunkingReport(config, len(blocks), heads, _apply_time_floors(
        patcher, [blocks[i] for i in indices]))
    runtime = ChunkingRuntime()
    hooks = []
    if config.active_with(heads):
        runtime.chunkers = {i: BlockChunker(blocks[i], config, report, runtime) for i in indices}
        hooks.append(protocol.wrapper(names.DIFFUSION_MODEL, runtime.diffusion_model_wrapper()))
        if config.head_group:
            hooks.append(protocol.override(lambda previous: HeadGroups(runtime, previous)))
    protocol.install(patcher, "chunking", *hooks, state=runtime)
    # live: the line becomes true once the wrapped forwards know what ran (adapters ComfyUI
    # injects at load, "auto"'s choices)
    protocol.record_status(patcher, "chunking", report.line(), live=report.line)
    return patcher


def get_chunking(model_patcher: Any) -> ChunkingRuntime | None:
    """The chunking runtime applied to a patcher (its blocks' chunkers), if any."""
    return protocol.find(model_patcher, "chunking")


def _apply_time_floors(patcher: Any, blocks: list[torch.nn.Module]):
    """The row floors the blocks have now, on the patcher's load device: the adapters injected
    on the modules at this moment (the twin's; ComfyUI injects its bypass adapters at load,
    and the wrappers look again), every block's ranks together."""
    from . import sizing

    if not blocks:
        return sizing.RowFloors()
    first = blocks[0]
    linears = block_linears(first)
    ranks: dict[str, tuple[int, ...]] = {name: () for name in linears}
    for block in blocks:
        for name, found in block_adapter_ranks(block).items():
            ranks[name] = tuple(sorted({*ranks[name], *found}))
    device = torch.device(getattr(patcher, "load_device", None) or "cpu")
    weight = getattr(first.attn.qkv_proj, "weight", None)
    dtype = weight.dtype if getattr(weight, "is_floating_point", lambda: False)() and \
        weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    return block_floors(linears, device, dtype, ranks)
