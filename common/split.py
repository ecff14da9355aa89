"""Who computes what: devices (root first) and the attention heads each of them computes.

One type for every feature that shares work over the root GPU and its helpers: Dual-Sage's
head shards (`dual_sage.shard_plan.ShardPlan`) and the sequence mode's row and head shares
(`sequence.split.SequenceSplit`) are both a `DeviceSplit`. Heads are contiguous ranges in device
order, rounded from throughput weights by `split_by_weights` / `heads_by_weights`.

Pure Python, no torch: the planner imports the rounding through the features' sizing modules
(a device is anything with a `.type`, such as `torch.device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def split_by_weights(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Largest-remainder rounding of `total` in proportion to `weights` (sums to `total`).

    Ties go to the earlier device, so equal weights give the root the larger share.
    """
    weight_sum = float(sum(weights))
    exact = [total * w / weight_sum for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (exact[i] - counts[i], -i), reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def heads_by_weights(heads: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Head counts proportional to `weights`, every device at least one head (taken from the
    largest share)."""
    if len(weights) > heads:
        raise ValueError(f"{len(weights)} devices for {heads} heads: every device needs at "
                         "least one head; use fewer GPUs")
    counts = list(split_by_weights(heads, weights))
    for i, c in enumerate(counts):
        if c == 0:
            donor = max(range(len(counts)), key=lambda j: counts[j])
            counts[donor] -= 1
            counts[i] = 1
    return tuple(counts)


def ranges_of(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, stop) ranges of consecutive counts."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return tuple(out)


@dataclass(frozen=True)
class DeviceSplit:
    """Devices (`devices[0]` the root) and the heads each computes, in device order."""

    devices: tuple[Any, ...]
    head_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.devices)
        if len(self.head_counts) != n:
            raise ValueError(f"{n} devices need {n} head counts, got {self.head_counts}; give "
                             "one count per device")
        if n < 2:
            raise ValueError(f"{self.what} needs the root and at least one helper device")
        if any(c < 1 for c in self.head_counts):
            raise ValueError(f"head split {self.head_counts} gives a device no heads; every "
                             "device needs at least one head (use fewer GPUs)")
        real = [d for d in self.devices if d.type != "cpu"]
        if len(set(real)) != len(real) and not self.shared_gpu_allowed():
            raise ValueError(f"the device list names a GPU twice: {[str(d) for d in self.devices]}"
                             "; helpers must differ from the root and from each other")

    @property
    def what(self) -> str:
        """The feature's words in refusals."""
        return "a device split"

    def shared_gpu_allowed(self) -> bool:
        """Whether two shares may name one GPU (only the sequence mode's plumbing tests)."""
        return False

    @property
    def heads(self) -> int:
        return sum(self.head_counts)

    @property
    def root(self) -> Any:
        return self.devices[0]

    @property
    def helpers(self) -> tuple[Any, ...]:
        return self.devices[1:]

    def head_ranges(self) -> tuple[tuple[int, int], ...]:
        return ranges_of(self.head_counts)

    def counts_for(self, heads: int) -> tuple[int, ...]:
        """Per-device head counts for a call with `heads` heads (the same weights; zeros
        allowed: a head-group call from activation chunking carries fewer heads)."""
        if heads == self.heads:
            return self.head_counts
        return split_by_weights(heads, self.head_counts)

    def ranges_for(self, heads: int) -> tuple[tuple[int, int], ...]:
        """Per-device [start, stop) head ranges for a call with `heads` heads."""
        return ranges_of(self.counts_for(heads))

    def describe(self) -> str:
        return " + ".join(f"{c}@{d}" for d, c in zip(self.devices, self.head_counts, strict=True))
