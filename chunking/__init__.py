"""Activation chunking for the H3 DiT: FFN/QKV row chunks and head-group attention, exact.

`apply_activation_chunking(model_patcher, ChunkingConfig(...))` runs upstream's own block with
its QKV/out projections and MLP on row chunks and its attention in head groups (`wrappers`), so
the big per-block intermediates (fc1 output, SwiGLU product, qkv LoRA/bypass outputs,
attention temporaries) are chunk-sized; `sizing` predicts the resulting peaks without torch.
The config and sizing names import without torch (the planner uses them); the torch-side names
load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import AUTO, ChunkingConfig
from .sizing import (
    Adapters,
    BlockDims,
    BlockPeak,
    ChunkChoice,
    Kernels,
    RowFloors,
    attention_phase_peak_bytes,
    block_peak_bytes,
    choose_chunks,
    mlp_phase_peak_bytes,
    row_chunks,
    unchunked_block_peak_bytes,
)

_TORCH_NAMES = {
    "apply_activation_chunking": "apply",
    "get_chunking": "apply",
    "BlockChunker": "wrappers",
    "ChunkingReport": "report",
    "RowPlan": "report",
    "free_device_bytes": "wrappers",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUTO",
    "Adapters",
    "BlockDims",
    "BlockPeak",
    "ChunkChoice",
    "ChunkingConfig",
    "Kernels",
    "RowFloors",
    "attention_phase_peak_bytes",
    "block_peak_bytes",
    "choose_chunks",
    "mlp_phase_peak_bytes",
    "row_chunks",
    "unchunked_block_peak_bytes",
    *_TORCH_NAMES,
]
