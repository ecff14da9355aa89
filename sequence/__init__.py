"""Sequence-parallel mode: every DiT block on every GPU, each on its share of the token rows.

Heads are exchanged around attention inside one process (Ulysses-style all-to-all on copy
engines: peer copies or a pinned host relay), so each GPU attends its head share over the whole
sequence with the attention function ComfyUI would call. Exact, no NCCL, no second process.

Modules: `config` (the config, and the planner's plan as one), `policy` (pure: devices, the
split, the exactness floor, the per-step mode by predicted time), `plan` (which block arguments
split along which rows, where the output gathers), `split` (rows and heads per device),
`runner` (one block's phases and the exchange), `patches` (the ComfyUI seam: the block patches,
the per-forward state, the wrappers), `helpers` (the helpers' clones or bound weights and their
lifecycle), `weights` (the blocks' weights on helpers: replica or streamed), `status` (the
status line), `sizing` (torch-free time and memory model for the planner).
Names load lazily so `sequence.sizing` imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "SequenceParallel": "patches",
    "SequenceParallelConfig": "config",
    "SPLIT_PLAN": "plan",
    "apply_sequence_parallel": "patches",
    "config_from_plan": "config",
    "get_sequence_parallel": "patches",
    "SequenceRunner": "runner",
    "SequenceSplit": "split",
    "HelperWeights": "weights",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
