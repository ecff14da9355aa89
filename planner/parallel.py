"""How the GPUs share each pass: the stage's output types and the rate conversions, shared with the
sequence mode's runtime (`sequence.sizing.gpu_speed` / `link_speed`).

Per pass (PASS1, PASS2) `planner.modes` predicts a step with each mode available, each with the
memory that mode has (its own chunking and residency), and keeps the fastest that fits, never
one slower than the root GPU alone:
- one GPU ("off"); heads (Dual-Sage's split, when Dual-Sage is planned and the length reaches
  its `min_tokens`); sequence (every GPU runs every block on its rows, when every row share keeps
  the exact range and the helper holds the DiT: a replica, or K + 1 streamed slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.floors import EXACT_MIN_ROWS  # the GPU row floor (torch-free)
from ..sequence.sizing import gpu_speed, link_speed  # the one conversion (runtime too)
from .request import PARALLEL_MODES as MODES

TWO_BY_TWO, TWO_BY_TWO_GPUS = "cfg_sequence", 4  # CFG split x sequence (planner.two_by_two)
MARGIN = 1.03  # a split mode must beat one GPU by this factor to be picked (and Dual-Sage set up)


@dataclass(frozen=True, kw_only=True)
class PassParallel:
    mode: str  # "sequence" | "heads" | "cfg" | "cfg_sequence" (2x2) | "off"
    reason: str
    step_time_s: float
    speedup: float  # over the root GPU alone
    helper_weights: str  # "replica" | "stream" | "none"
    root_activation_bytes: int = 0  # the mode's activation peak on the root
    helper_activation_bytes: int = 0  # sequence mode only
    helper_weight_bytes: int = 0  # the DiT's bytes on the helper (sequence mode only)
    options_s: dict[str, float] | None = None  # predicted step of each mode considered


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    requested: str
    row_weights: tuple[float, ...]
    head_split: tuple[int, ...]
    transport: str  # "peer" | "host" | "none"
    passes: dict[str, PassParallel]

    @property
    def sequence_used(self) -> bool:
        """The pack's sequence mode runs in some pass (alone, or in 2x2 inside CFG Split)."""
        return any(p.mode in ("sequence", TWO_BY_TWO) for p in self.passes.values())

    @property
    def two_by_two_used(self) -> bool:
        return any(p.mode == TWO_BY_TWO for p in self.passes.values())

    def sequence_devices(self, devices: list[int]) -> list[int]:
        """The sequence mode's devices, root first: in 2x2 the root and the three GPUs beside
        it (a fifth GPU and more sit idle: the groups must be even, `cfg_split_groups`)."""
        return devices[:TWO_BY_TWO_GPUS] if self.two_by_two_used else list(devices)

    def describe(self, name: str) -> str:
        p = self.passes[name]
        return f"{p.mode} ({p.speedup:.2f}x predicted) -- {p.reason}"


__all__ = ["EXACT_MIN_ROWS", "MARGIN", "MODES", "ParallelPlan", "PassParallel", "gpu_speed",
           "link_speed"]
