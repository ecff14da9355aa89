"""`PrefetchConfig`: how many DiT blocks stay resident and how the others stream.

Checked when it is made (a node's typo is refused before anything is cloned); the host's
memory size is the pinned budget's default outside ComfyUI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import sizing
from .streamer import Source

GIB = 1 << 30


@dataclass(frozen=True)
class PrefetchConfig:
    """How many DiT blocks stay resident and how the others stream.

    resident_blocks: a count (0..blocks) or "auto" (before the first load: as many as fit in
        the free VRAM minus `activation_reserve_bytes`, leaving room for the slots).
    lookahead: K, how many streamed blocks ahead are copied (K + 1 device slots).
    pinned_budget_bytes: page-locked host memory for block copies; None = inside ComfyUI what
        is left of ComfyUI's own pin budget (MAX_PINNED_MEMORY), outside it half the host's
        RAM. Inside ComfyUI a given budget is capped by ComfyUI's too. Blocks past it stay
        pageable and stream through a small pinned staging ring.
    source: "auto" (pinned within the budget, staged beyond), "pinned" (all pinned; the budget
        must cover them), "pageable" (all staged; least pinned memory).
    stream_refiner: stream the token refiner's blocks too (when any DiT block streams), once
        per sampling run, ahead of the DiT blocks.
    """

    resident_blocks: int | str = "auto"
    lookahead: int = 2
    pinned_budget_bytes: int | None = None
    source: str = "auto"
    stream_refiner: bool = True
    activation_reserve_bytes: int = 8 * GIB
    staging_buffers: int = sizing.STAGING_BUFFERS

    def __post_init__(self) -> None:
        r = self.resident_blocks
        if r != "auto" and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"resident_blocks={r!r}: use 'auto' or a block count >= 0")
        if not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ValueError(f"lookahead={self.lookahead!r}: use an integer >= 1 (2 is typical)")
        budget = self.pinned_budget_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"pinned_budget_bytes={budget!r}: use None (ComfyUI's pin budget, "
                             "or half the host RAM outside ComfyUI) or a byte count >= 0")
        if self.source not in {s.value for s in Source}:
            raise ValueError(f"source={self.source!r}: use 'auto', 'pinned' or 'pageable'")
        if self.activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes={self.activation_reserve_bytes}: use >= 0")
        if self.staging_buffers < 1:
            raise ValueError(f"staging_buffers={self.staging_buffers}: use >= 1 (2 is typical)")

    @property
    def source_mode(self) -> Source:
        return Source(self.source)

    @classmethod
    def from_plan(cls, prefetch: Any, **overrides: Any) -> PrefetchConfig:
        """From the planner's `Plan.prefetch` (resident_blocks, lookahead, pinned_budget_bytes)."""
        values = {"resident_blocks": prefetch.resident_blocks, "lookahead": prefetch.lookahead,
                  "pinned_budget_bytes": prefetch.pinned_budget_bytes}
        return cls(**{**values, **overrides})


def host_memory_bytes() -> int | None:
    """Physical host memory, or None when it cannot be read (then the budget is unlimited)."""
    try:
        import psutil  # ComfyUI depends on it; optional here
        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
