"""ComfyUI's MultiGPU CFG Split as a mode of a pass ("cfg"), beside one GPU, heads and sequence.

Above CFG 1 a sampling step makes two model calls, cond and uncond (at CFG 1 ComfyUI skips the
uncond: `samplers.cfg_function`). CFG Split (`MultiGPU_WorkUnits`, comfy/multigpu.py) gives
each extra GPU a deep clone of the model and runs the conds side by side, one a GPU, with no
exchange inside the forward: the step is the slower GPU's one call. The other modes run the two
calls one after the other (`StepTime.calls`).

What this module plans, with the same rates and memory model as the other modes:
- the extra GPU is core's first device other than the root, the planner's first helper (the
  GPU that also keeps the VAEs and the upscaler); a third or fourth GPU adds nothing for two
  conds;
- that GPU holds a whole DiT (ComfyUI's clone: its weights, the LoRA) beside one call's
  activations, or, when it cannot, ComfyUI streams the clone's blocks (DynamicVRAM one block
  ahead; the legacy loader's lowvram casts each block unhidden);
- the pack's chunking and block streamer do not run beside CFG Split's clones
  (`guard.composition`): the mode is planned unchunked (DynamicVRAM keeps fewer blocks resident
  instead), and refused where the root's blocks would need the pack's streamer (the legacy
  loader) or chunking is forced on, saying so; and since the
  clones serve the model in every pass, a job that splits CFG in one pass runs its other passes
  on one GPU (`resolve_job`);
- on four GPUs the pack's sequence mode can run inside CFG Split's copies, one pair a cond
  (2x2, `two_by_two`); it is a mode of its own, weighed with the others and, like this one,
  ruled by `resolve_job` (both are `CFG_MODES`).

Where a plan splits CFG, the drop-in node sets core's CFG Split up itself
(`nodes.features.apply_plan` -> `comfy_seam.clones.apply_cfg_split`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..common import geometry
from ..offload import sizing as offload_sizing
from . import timing
from .hardware import GiB
from .memory import ChunkSettings, block_activation_peak

if TYPE_CHECKING:
    from .modes import DiTContext, ModeOption, PassMemory
    from .residency import PrefetchPlan

SPARE_BYTES = int(0.5 * GiB)  # kept free beside a whole clone (the modes' MIN_SPARE_BYTES)
AT_CFG_1 = "CFG split has no effect at CFG 1 (one model call a step)"
NEEDS_CHUNKING = ("chunking is forced on, and the pack does not run it beside CFG Split's "
                  "clones")
NEEDS_STREAMER = ("the DiT streams on the root through the pack's block streamer (legacy "
                  "loader), which does not run beside CFG Split's clones")
CFG_MODES = ("cfg", "cfg_sequence")  # the modes that run on CFG Split's copies (two_by_two.MODE)
HOW = ("the H3 Multi-GPU node sets up ComfyUI's MultiGPU CFG Split (max_gpus 2) from this "
       "plan (or add that core node before the sampler); the pack's split, chunking and "
       "streaming features stay off for this model")


def clone_bytes(ctx: DiTContext) -> tuple[int, int]:
    """(a whole clone of the DiT with its LoRA, the same when ComfyUI streams its blocks)."""
    sizes = ctx.sizes
    fixed = max(0, sizes.dit_other_bytes - geometry.REFINER_BLOCKS * sizes.dit_block_bytes) \
        + sizes.lora_bytes
    whole = fixed + ctx.all_blocks_bytes
    streamed = fixed + offload_sizing.streamed_weight_vram_bytes(
        blocks=geometry.BLOCKS, resident=0, block_bytes=sizes.dit_block_bytes, lookahead=1,
        extra_streamed=geometry.REFINER_BLOCKS)
    return whole, streamed


def cfg_memory(ctx: DiTContext, tokens: int, chunks: ChunkSettings,
               helper_weights: str | None) -> PassMemory:
    """One call's activations on each GPU; the clone's weights on the helper."""
    from .modes import PassMemory

    peak = block_activation_peak(tokens, ctx.dims, chunks,
                                 lora_on_activations=ctx.request.lora_rank > 0,
                                 lora_rank=ctx.request.lora_rank, kernels=ctx.kernels)
    whole, streamed = clone_bytes(ctx)
    free = ctx.placement.helper_free_bytes
    refusal = NEEDS_CHUNKING if ctx.request.chunking == "on" else None
    if helper_weights != "stream" and whole + peak.peak_bytes + SPARE_BYTES <= free:
        weights, dit = "replica", whole
    elif streamed + peak.peak_bytes <= free:
        weights, dit = "stream", streamed
    else:
        weights, dit = "none", 0
        refusal = refusal or (f"gpu:{ctx.helpers[0]} cannot hold one call's "
                              f"{peak.peak_bytes / GiB:.1f} GiB of activations beside CFG "
                              f"Split's clone of the DiT ({streamed / GiB:.1f} GiB streamed)")
    return PassMemory(mode="cfg", chunks=chunks, root_activation_bytes=peak.peak_bytes,
                      phase=peak.phase, helper_activation_bytes=peak.peak_bytes,
                      helper_dit_bytes=dit, helper_weights=weights, refusal=refusal)


def with_root_refusal(memory: PassMemory, prefetch: PrefetchPlan) -> PassMemory:
    """The mode refused when the root's blocks would need the pack's streamer."""
    if memory.refusal is None and prefetch.streamer == "pack" and prefetch.streamed_blocks:
        return replace(memory, refusal=NEEDS_STREAMER)
    return memory


def cfg_step(ctx: DiTContext, *, tokens: int, prefetch: PrefetchPlan,
             helper_weights: str) -> timing.StepTime:
    """A step with the conds side by side: each GPU's block and unhidden copies, the slower."""
    link = ctx.profile.link
    block = ctx.sizes.dit_block_bytes
    copy = timing.block_copy_s(block, link, pinned_fraction=prefetch.pinned_fraction)
    root_block = timing.one_gpu_block_s(tokens, ctx.rates[ctx.root])
    helper_block = timing.one_gpu_block_s(tokens, ctx.rates[ctx.helpers[0]])
    root_stream = timing.streaming_s(comfy_streams=prefetch.streamer == "comfyui",
                                     streamed=prefetch.streamed_blocks, block_s=root_block,
                                     copy_s=copy)
    helper_stream = 0.0
    if helper_weights == "stream":
        streamed = geometry.BLOCKS
        helper_stream = (timing.streaming_s(comfy_streams=True, streamed=streamed,
                                            block_s=helper_block, copy_s=copy)
                         if ctx.loader.dynamic else streamed * copy)  # lowvram: no prefetch
    return timing.StepTime(mode="cfg", block_s=max(root_block, helper_block),
                           streaming_s=max(root_stream, helper_stream), calls=1)


@dataclass(frozen=True)
class JobChoice:
    """Per pass the option that runs, after the whole-model rule of CFG Split's clones."""

    chosen: dict[str, str]  # pass -> mode
    note: str  # why the job's modes differ from each pass's own best ("" when they do not)


def _compatible(option: ModeOption) -> bool:
    """A pass's option that can run beside CFG Split's clones (one GPU, nothing of the pack's
    chunking or streamer), or the split itself."""
    if option.memory.mode in CFG_MODES:
        return True
    return (option.memory.mode == "off" and not option.memory.chunks.active
            and not (option.prefetch.streamer == "pack" and option.prefetch.streamed_blocks))


def resolve_job(picks: dict[str, str], without_cfg: dict[str, str],
                options: dict[str, dict[str, ModeOption]], steps: dict[str, int]) -> JobChoice:
    """CFG Split's clones sit on the model, so every pass of the job runs beside them: where a
    pass picks "cfg" (`picks`) and another pass a mode that cannot run beside it, keep the
    faster job of two: CFG split with the other passes on one GPU, or each pass's choice
    without CFG split (`without_cfg`)."""
    if not set(CFG_MODES) & set(picks.values()) or all(
            _compatible(options[name][mode]) for name, mode in picks.items()):
        return JobChoice(dict(picks), "")

    def job_s(modes: dict[str, str]) -> float:
        return sum(steps[n] * options[n][m].step.total_s for n, m in modes.items())

    def beside(name: str) -> str:
        """A pass's fastest fitting mode on CFG Split's copies, else one GPU."""
        family = [m for m in CFG_MODES if m in options[name] and options[name][m].fits]
        return min(family, key=lambda m: options[name][m].step.total_s) if family else "off"

    with_cfg = {name: (mode if mode in CFG_MODES else beside(name))
                for name, mode in picks.items()}
    feasible = all(_compatible(options[name][mode]) and options[name][mode].fits
                   for name, mode in with_cfg.items())
    labels = {"pass1": "PASS1", "pass2": "PASS2"}
    split = ", ".join(labels[n] for n, m in picks.items() if m in CFG_MODES)
    words = {"cfg": "CFG split", "cfg_sequence": "CFG split x sequence (2x2)",
             "off": "on one GPU"}
    changes = ", ".join(f"{labels[n]} runs {words[with_cfg[n]]} instead of {picks[n]}"
                        for n in picks if with_cfg[n] != picks[n])
    if feasible and job_s(with_cfg) < job_s(without_cfg):
        return JobChoice(with_cfg, (
            f"CFG Split's clones serve every pass: {changes} (job {job_s(with_cfg):.0f} s, "
            f"against {job_s(without_cfg):.0f} s without CFG split)"))
    why = (f"beside its clones {changes}" if feasible else
           "another pass needs the pack's chunking or streamer (which do not run beside its "
           "clones) or does not fit on one GPU")
    return JobChoice(dict(without_cfg), (
        f"CFG split in {split} not taken: {why} (job {job_s(without_cfg):.0f} s without it"
        + (f", {job_s(with_cfg):.0f} s with it)" if feasible else ")")))
