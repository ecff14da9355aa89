"""Dual-Sage: H3's attention heads sharded across GPUs, exact, overlapped with the root's work."""

from .apply import DualSageConfig, DualSageOverride, apply_dual_sage, status_text
from .shard_plan import ShardPlan, parse_devices, parse_split, split_weighted
from .sharded import ShardedAttention
from .transport import TransportMode

__all__ = [
    "DualSageConfig",
    "DualSageOverride",
    "ShardPlan",
    "ShardedAttention",
    "TransportMode",
    "apply_dual_sage",
    "parse_devices",
    "parse_split",
    "split_weighted",
    "status_text",
]
