"""How a total (attention heads, token rows) is shared over devices in proportion to weights.

Pure Python, no torch: the planner imports it through the features' sizing modules.
"""

from __future__ import annotations

from collections.abc import Sequence


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
