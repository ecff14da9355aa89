"""Which multi-GPU mode each pass runs: sequence parallel, Dual-Sage (heads) or one GPU.

Per pass (PASS1, PASS2) the planner predicts a step with each mode available and keeps the
fastest, never one slower than the root GPU alone:
- one GPU: the existing step model (`plan._step_time` without helpers);
- heads: the same with Dual-Sage's split (when Dual-Sage is planned and the length reaches its
  `min_tokens`);
- sequence: `sequence.sizing.sequence_block_ms` per block (rows and heads split by the GPUs'
  throughputs, the link's traffic, the root's streaming overhead), when every row share keeps
  the exact range (>= 4096 rows) and the helper can hold the DiT (a replica when it fits beside
  the VAEs, the upscaler and its activations, else K + 1 streamed slots).
Memory per GPU under the sequence mode comes from `sequence.sizing.sequence_memory` (about half
the activations of one GPU; the root keeps the whole residual stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import geometry
from ..offload import sizing as offload_sizing
from ..sequence import sizing as sequence_sizing
from .hardware import GiB, GPUSpec, HardwareProfile

EXACT_MIN_ROWS = 4096  # sequence.split.EXACT_MIN_ROWS_GPU (kept torch-free here)
MODES = ("auto", "sequence", "heads", "off")


@dataclass(frozen=True)
class PassParallel:
    mode: str  # "sequence" | "heads" | "off"
    reason: str
    step_time_s: float
    speedup: float  # over the root GPU alone
    helper_weights: str  # "replica" | "stream" | "none"
    root_activation_bytes: int = 0  # sequence mode only
    helper_activation_bytes: int = 0
    helper_weight_bytes: int = 0


@dataclass(frozen=True)
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


def gpu_speed(gpu: GPUSpec, quantized: bool = False) -> sequence_sizing.GPUSpeed:
    attention = gpu.int8_attention_tflops if quantized and gpu.int8_attention_tflops else \
        gpu.attention_tflops
    return sequence_sizing.GPUSpeed(gpu.matmul_tflops, attention, gpu.memory_bandwidth_gbs)


def link_speed(profile: HardwareProfile) -> sequence_sizing.LinkSpeed:
    link = profile.link
    if link.peer_access:
        return sequence_sizing.LinkSpeed(link.peer_gbs, False, link.host_pinned_gbs)
    return sequence_sizing.LinkSpeed(link.host_pinned_gbs, True, link.host_pinned_gbs)


def plan_parallel(*, requested: str, profile: HardwareProfile, root: int, helpers: list[int],
                  tokens: dict[str, int], single_step_s: dict[str, float],
                  heads_step_s: dict[str, float], heads_active: dict[str, bool],
                  block_bytes: int, helper_free_bytes: int, streamed_root_blocks: int,
                  root_block_copy_s: float, lora_rank: int, fused_swiglu: bool,
                  quantized: bool, ffn_chunk: int = 0, margin: float = 1.03) -> ParallelPlan:
    """The mode per pass and, for the sequence mode, its per-GPU memory and step time."""
    if requested not in MODES:
        raise ValueError(f"parallel={requested!r} is not valid; use one of {MODES}")
    gpus = [profile.gpus[root]] + [profile.gpus[h] for h in helpers]
    transport = "none" if not helpers else ("peer" if profile.link.peer_access else "host")
    weights = tuple(g.matmul_tflops for g in gpus)
    if len(set(weights)) <= 1:
        weights = (1.0,) * len(gpus)
    heads = sequence_sizing.split_counts(geometry.HEADS, weights)
    passes = {}
    for name, s in tokens.items():
        passes[name] = _one_pass(
            requested, name, s, gpus, weights, heads, profile, single_step_s[name],
            heads_step_s[name], heads_active[name], block_bytes, helper_free_bytes,
            streamed_root_blocks, root_block_copy_s, lora_rank, fused_swiglu, quantized,
            ffn_chunk, margin)
    return ParallelPlan(requested, weights, tuple(heads), transport, passes)


def _one_pass(requested, name, s, gpus, weights, heads, profile, single_s, heads_s, heads_ok,
              block_bytes, helper_free, streamed_root, root_copy_s, lora_rank, fused_swiglu,
              quantized, ffn_chunk, margin) -> PassParallel:
    label = name.upper()
    if len(gpus) < 2:
        return PassParallel("off", "one GPU", single_s, 1.0, "none")
    if requested == "off":
        return PassParallel("off", "switched off", single_s, 1.0, "none")
    shares = sequence_sizing.split_counts(s, weights)
    refusal = None
    if min(shares) < EXACT_MIN_ROWS:
        refusal = (f"{s:,} tokens give a GPU {min(shares):,} rows, below the exact range "
                   f"({EXACT_MIN_ROWS:,})")
    adapters = sequence_sizing.block_sizing.Adapters.turbo_lora(lora_rank)
    kernels = sequence_sizing.block_sizing.Kernels(mlp="comfy" if fused_swiglu else "twin")
    memory = sequence_sizing.sequence_memory(s, heads, row_weights=weights, adapters=adapters,
                                             kernels=kernels, ffn_chunk=ffn_chunk)
    helper_act = max(m.peak for m in memory[1:])
    replica = geometry.BLOCKS * block_bytes
    slots = sequence_sizing.helper_weight_bytes(block_bytes, geometry.BLOCKS, replica=False)
    if replica + helper_act <= helper_free:
        helper_weights, helper_weight_bytes = "replica", replica
    elif slots + helper_act <= helper_free:
        helper_weights, helper_weight_bytes = "stream", slots
    else:
        helper_weights, helper_weight_bytes = "none", 0
        refusal = refusal or (f"the helper cannot hold {helper_act / GiB:.1f} GiB of "
                              f"activations beside the DiT's streaming slots")
    speeds = [gpu_speed(g, quantized) for g in gpus]
    link = link_speed(profile)
    block_ms = sequence_sizing.sequence_block_ms(
        s, speeds, heads, link, row_weights=weights,
        streamed_block_bytes=block_bytes if helper_weights == "stream" else 0)
    block_s = block_ms / 1e3
    overhead = offload_sizing.step_overhead_seconds(
        blocks=geometry.BLOCKS, streamed=streamed_root, block_compute_s=block_s,
        block_copy_s=root_copy_s)
    seq_s = geometry.BLOCKS * block_s + overhead
    options = {"off": single_s}
    if heads_ok:
        options["heads"] = heads_s
    if refusal is None:
        options["sequence"] = seq_s
    if requested == "sequence":
        mode = "sequence" if refusal is None else ("heads" if heads_ok else "off")
        why = "forced" if refusal is None else f"sequence refused: {refusal}"
    elif requested == "heads":
        mode = "heads" if heads_ok else "off"
        why = "forced" if heads_ok else "Dual-Sage is off or below its min_tokens"
    else:
        mode = min(options, key=options.get)  # type: ignore[arg-type]
        if mode != "off" and single_s / options[mode] < margin:
            mode = "off"
        why = ", ".join(f"{m} {t:.2f} s/it" for m, t in sorted(options.items()))
        why = f"{label} predicted {why}"
        if refusal is not None:
            why += f"; sequence refused: {refusal}"
    step = options.get(mode, single_s)
    if mode != "sequence":
        return PassParallel(mode, why, step, single_s / step, "none")
    return PassParallel(mode, why + f"; helper weights {helper_weights}", step, single_s / step,
                        helper_weights, memory[0].peak, helper_act, helper_weight_bytes)
