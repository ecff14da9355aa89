"""Which heads go where: a declarative shard plan over the root and its helper GPUs.

`ShardPlan.devices[0]` is the root (the GPU running the DiT, where q, k, v live); the others are
helpers. Heads are contiguous ranges in device order. The plan is written for the model's head
count (56 for H3) and rescaled, with the same weights, when a call carries fewer heads (a
head-group call from activation chunking): then a device may get zero heads for that call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..exchange.shares import heads_by_weights, split_by_weights


def parse_split(text: str, heads: int, devices: int) -> tuple[int, ...]:
    """Head counts from "auto" (equal), a count split "28:28" or relative throughputs "1.0:0.7".

    A split of integers that sums to `heads` is taken as head counts; any other list of
    positive numbers is a throughput ratio and is rounded to head counts.
    """
    text = text.strip().lower()
    if text in ("auto", ""):
        return split_weighted(heads, [1.0] * devices)
    parts = [p.strip() for p in text.replace(",", ":").split(":")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"head split {text!r} is not a list of numbers; write it like "
                         f"'{heads // devices}:{heads - heads // devices}' or 'auto'") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"head split {text!r} holds a value that is not a finite number; write "
                         f"head counts like '{heads // devices}:{heads - heads // devices}' or "
                         f"'auto'")
    if len(values) != devices:
        raise ValueError(f"head split {text!r} has {len(values)} entries for {devices} devices "
                         f"(root first, then each helper); give one entry per device")
    if any(v <= 0 for v in values):
        raise ValueError(f"head split {text!r} gives a device no heads; every device needs at "
                         "least one head (drop the device from the helpers instead)")
    if all(v.is_integer() for v in values) and sum(values) != heads and \
            all(p.isdigit() for p in parts):
        raise ValueError(f"head split {text!r} sums to {int(sum(values))} but the model has "
                         f"{heads} heads; make the counts sum to {heads} or use 'auto'")
    if all(p.isdigit() for p in parts):
        return tuple(int(v) for v in values)
    return split_weighted(heads, values)


def split_weighted(heads: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Head counts proportional to device throughputs, each device at least one head."""
    return heads_by_weights(heads, weights)


@dataclass(frozen=True)
class ShardPlan:
    """Head counts per device; `devices[0]` is the root."""

    devices: tuple[torch.device, ...]
    head_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.head_counts):
            raise ValueError(f"shard plan has {len(self.devices)} devices but "
                             f"{len(self.head_counts)} head counts; give one count per device")
        if len(self.devices) < 2:
            raise ValueError("a shard plan needs the root and at least one helper device")
        if any(c <= 0 for c in self.head_counts):
            raise ValueError(f"head split {self.head_counts} gives a device no heads; every "
                             "device needs at least one head")
        real = [d for d in self.devices if d.type != "cpu"]
        if len(set(real)) != len(real):
            raise ValueError(f"shard plan lists a GPU twice: {[str(d) for d in self.devices]}; "
                             "helpers must differ from the root and from each other")

    @property
    def heads(self) -> int:
        return sum(self.head_counts)

    @property
    def root(self) -> torch.device:
        return self.devices[0]

    @property
    def helpers(self) -> tuple[torch.device, ...]:
        return self.devices[1:]

    def counts_for(self, heads: int) -> tuple[int, ...]:
        """Per-device head counts for a call with `heads` heads (zeros allowed)."""
        if heads == self.heads:
            return self.head_counts
        return split_by_weights(heads, self.head_counts)

    def ranges_for(self, heads: int) -> tuple[tuple[int, int], ...]:
        """Per-device [start, stop) head ranges for a call with `heads` heads."""
        out, start = [], 0
        for count in self.counts_for(heads):
            out.append((start, start + count))
            start += count
        return tuple(out)

    def describe(self) -> str:
        return " + ".join(f"{c}@{d}" for d, c in zip(self.devices, self.head_counts, strict=True))
