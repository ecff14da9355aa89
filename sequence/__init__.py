"""Sequence-parallel mode: every DiT block on every GPU, each on its share of the token rows.

Heads are exchanged around attention inside one process (Ulysses-style all-to-all on copy
engines: peer copies or a pinned host relay), so each GPU attends its head share over the whole
sequence with the attention function ComfyUI would call. Exact, no NCCL, no second process.

Modules: `split` (rows and heads per device), `runner` (one block's phases and the exchange),
`weights` (the blocks' weights on helpers: replica or streamed), `apply` (the ComfyUI seam and
the per-step mode choice), `sizing` (torch-free time and memory model for the planner).
Names load lazily so `sequence.sizing` imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "SequenceParallel": "apply",
    "SequenceParallelConfig": "apply",
    "apply_sequence_parallel": "apply",
    "config_from_plan": "apply",
    "get_sequence_parallel": "apply",
    "SequenceRunner": "runner",
    "SequenceSplit": "split",
    "HelperWeights": "weights",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
