"""Which multi-GPU mode runs a DiT forward: one word in `transformer_options`, read by both modes.

The sequence-parallel mode decides per forward (from the packed length, at its first block) and
writes its choice under `PARALLEL_KEY`. Dual-Sage's attention override honours it: under
"sequence" the attention calls it sees are already per head share on each GPU, and under "off"
the step runs on one GPU, so it calls ComfyUI's function unchanged. Without the key (the
sequence mode not installed) Dual-Sage decides alone, as before.
"""

from __future__ import annotations

import enum
from typing import Any

from ..comfy_seam.names import PARALLEL_KEY


class ParallelMode(enum.Enum):
    AUTO = "auto"  # the faster of the modes below, by predicted time (never slower than one GPU)
    SEQUENCE = "sequence"  # token rows split over GPUs for the whole block, heads exchanged
    HEADS = "heads"  # Dual-Sage: attention heads sharded per call
    OFF = "off"  # one GPU

    @classmethod
    def parse(cls, value: ParallelMode | str) -> ParallelMode:
        if isinstance(value, ParallelMode):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"parallel {value!r} is unknown; use 'auto', 'sequence', 'heads' "
                             "or 'off'") from None


def heads_allowed(transformer_options: Any) -> bool:
    """False when this forward runs sequence-parallel or on one GPU (Dual-Sage stands aside)."""
    if not isinstance(transformer_options, dict):
        return True
    return transformer_options.get(PARALLEL_KEY) not in (ParallelMode.SEQUENCE.value,
                                                          ParallelMode.OFF.value)
