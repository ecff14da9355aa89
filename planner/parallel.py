"""How the GPUs share each pass: the stage's output types and the rate conversions the sequence
mode's runtime reuses (`sequence.apply.config_from_plan`).

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
from ..sequence import sizing as sequence_sizing
from .hardware import GPUSpec, HardwareProfile
from .request import PARALLEL_MODES as MODES
from .timing import link_speed as _link_speed


@dataclass(frozen=True, kw_only=True)
class PassParallel:
    mode: str  # "sequence" | "heads" | "off"
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
        return any(p.mode == "sequence" for p in self.passes.values())

    def describe(self, name: str) -> str:
        p = self.passes[name]
        return f"{p.mode} ({p.speedup:.2f}x predicted) -- {p.reason}"


def gpu_speed(gpu: GPUSpec, attention: bool | str = False) -> sequence_sizing.GPUSpeed:
    """The sequence mode's rates of one GPU: bf16 GEMMs, the attention kernel (`attention` a
    kernel name, or the old flag: True = the fastest INT8-QK kernel), memory bandwidth."""
    if isinstance(attention, str):
        rate = gpu.attention_rate(attention)[0]
    else:
        rate = gpu.int8_attention_tflops if attention and gpu.int8_attention_tflops else \
            gpu.attention_tflops
    return sequence_sizing.GPUSpeed(gpu.matmul_tflops, rate, gpu.memory_bandwidth_gbs)


def link_speed(profile: HardwareProfile) -> sequence_sizing.LinkSpeed:
    return _link_speed(profile.link)


__all__ = ["EXACT_MIN_ROWS", "MODES", "ParallelPlan", "PassParallel", "gpu_speed", "link_speed"]
