"""Dual-Sage: H3's attention heads sharded across GPUs, exact, overlapped with the root's work.

Names load lazily so `dual_sage.sizing` (pure Python) imports without torch: the planner uses it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "DualSageConfig": "apply",
    "DualSageOverride": "apply",
    "ShardingFunction": "apply",
    "apply_dual_sage": "apply",
    "get_sharded_attention": "apply",
    "status_text": "apply",
    "ShardPlan": "shard_plan",
    "parse_split": "shard_plan",
    "split_weighted": "shard_plan",
    "ShardedAttention": "sharded",
    "TransportMode": "apply",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
