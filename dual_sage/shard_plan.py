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

from ..common.split import DeviceSplit, heads_by_weights


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
class ShardPlan(DeviceSplit):
    """Head counts per device; `devices[0]` is the root (`common.split.DeviceSplit`: counts and
    ranges for a call with fewer heads, `describe`)."""

    @property
    def what(self) -> str:
        return "a shard plan"
