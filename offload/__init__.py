"""Pinned-memory weight prefetcher: DiT blocks stream from host memory just ahead of use.

What moves: `weights` (a block's tensors in one flat layout), `common.arena` (host copies,
pinned within a budget, a staging ring beyond), `common.slots` (the device slot ring). When it
moves: `streamer` (begin/end hooks around each streamed block, copies on a side stream ordered
by events), with `common.engine` (CUDA/ROCm streams or synchronous CPU copies). Which blocks
stream: `policy`. Sizes for the planner, torch-free: `sizing`. Settings: `config`. ComfyUI
seam: `apply` and its hooks, `comfy_hooks`; ComfyUI's memory (free VRAM, its pin budget,
DynamicVRAM) through `comfy_seam.memory`, which the other features ask too. Under ComfyUI's
DynamicVRAM the prefetcher stands aside (ComfyUI streams); it serves the legacy loader.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# names load lazily so `offload.sizing` (pure Python) imports without torch for the planner
_LAZY = {
    "BlockPrefetch": "apply",
    "PrefetchConfig": "config",
    "apply_block_prefetch": "apply",
    "get_block_prefetch": "apply",
    "spread_resident": "policy",
    "streamed_order": "policy",
    "BlockStreamer": "streamer",
    "Source": "streamer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
