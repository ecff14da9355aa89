"""The placement plan: where each component goes, how each pass runs, what each GPU peaks at,
how long the job takes, and why.

`plan_job(PlanRequest(...))` is the single source of truth the nodes, the CLI and the features
read. It runs typed stages in this order, each a dataclass handed to the next:
1. request (`PlanRequest`, checked at construction) with its loader, sizes and attention;
2. placement (`Placement`): the text encoder, VAEs and upscaler on the helper GPU0, the DiT and
   sampler on the root GPU1;
3. mode per pass (`ModeDecision`): one GPU, Dual-Sage heads or sequence parallel, each candidate
   planned with its own memory, the fastest that fits kept;
4. memory for those modes (`MemoryLayout`): the chunking, the resident DiT blocks (under the
   loader that runs: ComfyUI's DynamicVRAM or the pack's streamer on the legacy loader), every
   GPU's phases and the video decode (`DecodePlan`);
5. time (`JobTime`): every step of both passes with that residency, the upscale and the decode;
6. verdict (`Verdict`): fits or not (every GPU's phases, and the host RAM for what the job keeps
   there: `HostMemoryPlan`), tight phases, and what to change to fit or to go faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..chunking import sizing as block_sizing
from ..common import geometry
from . import cfg_split, two_by_two
from .attention import AttentionChoice, missing_kernel_notes, resolve_attention
from .checkpoint_check import check_dit_file
from .components import OFFICIAL, ComponentSizes, bf16_sizes, checkpoint_attention
from .components import dit_sizes_from_file as _dit_sizes_from_file
from .decode import DecodePlan
from .hardware import HardwareProfile, detect_hardware, get_profile
from .heads import DualSageSetup, plan_dual_sage
from .host import HostMemoryPlan, plan_host_memory
from .layout import (
    MODE_WORDS,
    ChunkPlan,
    GPUPlan,
    MemoryLayout,
    PhaseMemory,
    plan_decode_phase,
    plan_memory,
)
from .memory import BlockDims
from .modes import (
    LABELS,
    DiTContext,
    ModeDecision,
    decide_modes,
    dit_fixed_bytes,
    pass_step,
)
from .parallel import ParallelPlan
from .placement import Placement, place, reserve_bytes
from .request import PlanRequest
from .residency import LoaderPlan, PrefetchPlan, plan_loader
from .timing import JobTime, gpu_rates, upscale_s
from .verdict import Verdict, advise, check_memory

TURBO_LORA_RANK = 128  # the rank of the built-in LoRA size (the 8-step turbo LoRA)

__all__ = ["ChunkPlan", "DualSagePlan", "GPUPlan", "LoaderPlan", "PhaseMemory", "Plan",
           "PlanRequest", "PrefetchPlan", "plan_job", "reserve_bytes"]


@dataclass(frozen=True, kw_only=True)
class DualSagePlan:
    """Dual-Sage as the plan uses it: "on" (a pass runs heads mode), "standby" (installed, the
    passes run sequence parallel and a step that falls back to heads mode shards), "off"."""

    state: str
    helper_devices: tuple[int, ...]
    split: tuple[int, ...]  # heads per device, root first
    min_tokens: int
    transport: str  # "peer" | "host" | "none"
    reason: str

    @property
    def enabled(self) -> bool:
        """Installed on the model (the features read this)."""
        return self.state in ("on", "standby")


@dataclass
class Plan:
    request: PlanRequest
    profile: HardwareProfile
    sizes: ComponentSizes
    pass1: geometry.PassGeometry
    pass2: geometry.PassGeometry
    root_device: int
    helper_devices: list[int]
    placement: dict[str, int]
    dual_sage: DualSagePlan
    chunking: ChunkPlan
    prefetch: PrefetchPlan
    gpus: list[GPUPlan]
    step_time_s: dict[str, float]
    single_gpu_step_time_s: dict[str, float]
    attention: AttentionChoice
    job_time: JobTime
    verdict: Verdict
    notes: list[str] = field(default_factory=list)
    parallel: ParallelPlan | None = None
    decode: DecodePlan | None = None
    loader: LoaderPlan | None = None
    host: HostMemoryPlan | None = None
    # the block's kernels the memory model used: upstream H3's for this weight format, the
    # answer the run reads off the loaded block (`Kernels.of`)
    kernels: block_sizing.Kernels = field(default_factory=block_sizing.Kernels)

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    @property
    def problems(self) -> list[str]:
        return self.verdict.problems

    @property
    def suggestions(self) -> list[str]:
        return self.verdict.suggestions

    @property
    def tokens(self) -> int:
        return self.pass2.tokens

    def report(self) -> str:
        from .report import render_report

        return render_report(self)

    def to_dict(self) -> dict:
        from .report import plan_to_dict

        return plan_to_dict(self)


def plan_job(request: PlanRequest, *, suggest: bool = True) -> Plan:
    """Plan one two-pass job; raises ValueError for invalid input (nothing is loaded).

    `suggest=False` skips the advice (the fixes of a job that does not fit and the faster
    alternatives of one that does), which plans other jobs.
    """
    # 1. the request's hardware, loader, component sizes and attention kernel
    profile = _resolve_profile(request.profile)
    loader = plan_loader(request, profile)
    sizes = _sizes(request)
    attention = resolve_attention(
        requested=request.attention,
        checkpoint_kernel=checkpoint_attention(request.dit_file) if request.dit_file else None)
    rates = tuple(gpu_rates(g, dit_dtype=request.dit_dtype, attention=attention.kernel)
                  for g in profile.gpus)
    shapes = {"pass1": geometry.PassGeometry(request.pass1_width, request.pass1_height,
                                             request.frame_count),
              "pass2": geometry.PassGeometry(request.width, request.height,
                                             request.frame_count)}
    tokens = {name: p.tokens + request.text_tokens for name, p in shapes.items()}
    # 2. placement
    placement = place(profile=profile, sizes=sizes)
    # 3. mode per pass, each candidate with its own memory and time
    dual = plan_dual_sage(request=request, profile=profile, placement=placement, rates=rates,
                          tokens=tokens["pass2"])
    ctx = DiTContext(request=request, profile=profile, placement=placement, sizes=sizes,
                     loader=loader, attention=attention, rates=rates,
                     dims=BlockDims(element_bytes=2),
                     kernels=block_sizing.Kernels.of(weight_format=request.dit_weight_format),
                     dual=dual, shapes=shapes, tokens=tokens)
    decision = decide_modes(ctx)
    # 4. memory for the modes that run, then the decode beside it
    layout = plan_memory(ctx, decision)
    decode = plan_decode_phase(ctx, layout.gpus)
    # 5. time: every pass with the final residency; the job
    parallel, step, single = _final_times(ctx, decision, layout)
    job = JobTime(pass1_steps=request.pass1_steps, pass1_step_s=step["pass1"],
                  pass2_steps=request.pass2_steps, pass2_step_s=step["pass2"],
                  # the latent upscale runs between the passes (not in a one-pass job)
                  upscale_s=upscale_s(shapes["pass1"], shapes["pass2"],
                                      profile.gpus[placement.components["latent_upscaler"]])
                  if request.pass1_steps and request.pass2_steps else 0.0,
                  decode_s=decode.seconds)
    # 6. verdict and advice: every GPU's phases, then the host's RAM for what it keeps
    verdict = check_memory(layout.gpus)
    host = plan_host_memory(sizes=sizes, loader=loader, prefetch=layout.prefetch,
                            frames=request.frame_count, width=request.width,
                            height=request.height, available_bytes=profile.host_ram_bytes,
                            source=profile.host_ram_source)
    if not host.fits:
        verdict.problems.append(host.problem())
    plan = Plan(request=request, profile=profile, sizes=sizes, pass1=shapes["pass1"],
                pass2=shapes["pass2"], root_device=placement.root,
                helper_devices=list(placement.helpers), placement=dict(placement.components),
                dual_sage=_dual_sage_plan(ctx, dual, decision), chunking=layout.chunking,
                prefetch=layout.prefetch, gpus=layout.gpus, step_time_s=step,
                single_gpu_step_time_s=single, attention=attention, job_time=job,
                verdict=verdict, parallel=parallel, decode=decode, loader=loader, host=host,
                kernels=ctx.kernels, notes=[*layout.notes, *_range_notes(ctx, placement, profile)])
    advise(plan, suggest)
    return plan


def _resolve_profile(profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    return detect_hardware() if profile == "auto" else get_profile(profile)


def _sizes(request: PlanRequest) -> ComponentSizes:
    sizes = bf16_sizes(OFFICIAL) if request.dit_dtype == "bf16" else OFFICIAL
    if request.dit_file:
        check_dit_file(request.dit_file)  # a truncated, mislabelled or foreign file: refused
        sizes = _dit_sizes_from_file(request.dit_file, sizes)
    # LoRA weights scale with the rank: the built-in size is the turbo LoRA's, at rank 128
    return replace(sizes, lora_bytes=sizes.lora_bytes * request.lora_rank // TURBO_LORA_RANK)


def _final_times(ctx: DiTContext, decision: ModeDecision, layout: MemoryLayout
                 ) -> tuple[ParallelPlan, dict[str, float], dict[str, float]]:
    """Each pass's step in its mode with the model's final residency (the decision timed each
    candidate with its own); the one-GPU times stay those of the root alone."""
    step, single, passes = {}, {}, {}
    for name, choice in decision.parallel.passes.items():
        memory = layout.passes[name]
        timed = pass_step(ctx, mode=choice.mode, tokens=ctx.tokens[name],
                          prefetch=layout.prefetch, helper_weights=memory.helper_weights,
                          calls=ctx.request.model_calls(name))
        step[name] = timed.total_s
        single[name] = decision.single[name].step.total_s
        why = choice.reason
        if memory.mode == "sequence":
            why += f"; helper DiT: {memory.helper_weights}"
        elif memory.mode == "cfg":
            why += (f"; gpu:{ctx.helpers[0]} holds CFG Split's clone of the DiT as a "
                    f"{memory.helper_weights}: {cfg_split.HOW}")
        elif memory.mode == two_by_two.MODE:
            pairs = " and ".join("+".join(f"gpu:{i}" for i in pair)
                                 for pair in two_by_two.pairs(ctx))
            why += f"; pairs {pairs}, each GPU a whole DiT: {two_by_two.HOW}"
        passes[name] = replace(choice, reason=why, step_time_s=step[name],
                               speedup=single[name] / step[name],
                               helper_weights=memory.helper_weights,
                               root_activation_bytes=memory.root_activation_bytes,
                               helper_activation_bytes=memory.helper_activation_bytes,
                               helper_weight_bytes=memory.helper_dit_bytes)
    return replace(decision.parallel, passes=passes), step, single


def _dual_sage_plan(ctx: DiTContext, dual: DualSageSetup, decision: ModeDecision
                    ) -> DualSagePlan:
    """Dual-Sage as installed: on where a pass runs heads mode, standby beside the sequence
    mode (a step that falls back to heads mode shards), with min_tokens above every pass that
    runs on one GPU (Dual-Sage shards every call from min_tokens up)."""
    passes = decision.parallel.passes
    modes = {p.mode for p in passes.values()}
    words = ", ".join(f"{LABELS[n]} {MODE_WORDS[p.mode]}" for n, p in passes.items())
    min_tokens = dual.min_tokens
    if not dual.possible:
        state, reason = "off", dual.reason
    elif "heads" in modes:
        state, reason = "on", dual.reason
    elif "sequence" in modes:
        state, reason = "standby", (f"no pass runs heads mode ({words}); installed for a step "
                                    f"that falls back to it ({dual.reason})")
    else:
        state, reason = "off", f"no pass runs faster with it ({words})"
    alone = [ctx.tokens[n] for n, p in passes.items() if p.mode == "off"]
    heads = [ctx.tokens[n] for n, p in passes.items() if p.mode == "heads"]
    if state != "off" and alone and max(alone) >= min_tokens:
        floor = max(alone) + 1
        if all(t >= floor for t in heads):
            min_tokens = floor
            reason += (f"; min_tokens raised to {floor:,} so the pass on one GPU stays "
                       "unsharded")
        else:
            reason += ("; a pass on one GPU is longer than one in heads mode: Dual-Sage shards "
                       "it too at run time (min_tokens cannot tell them apart)")
    off = state == "off"
    return DualSagePlan(state=state, helper_devices=() if off else tuple(ctx.placement.helpers),
                        split=(geometry.HEADS,) if off else dual.split, min_tokens=min_tokens,
                        transport=dual.transport, reason=reason)


def _range_notes(ctx: DiTContext, placement: Placement, profile: HardwareProfile) -> list[str]:
    """What the plan accepts but the user should know: untrained sizes, a missing kernel, a
    card the hardware data does not list."""
    pass1, pass2 = ctx.shapes["pass1"], ctx.shapes["pass2"]
    notes = [w for w in (geometry.canvas_warning(pass1.width, pass1.height, "PASS1"),
                         geometry.canvas_warning(pass2.width, pass2.height, "PASS2"),
                         geometry.frames_warning(pass2.frames)) if w]
    devices = [placement.root, *placement.helpers]
    notes += missing_kernel_notes(ctx.attention, profile, devices)
    for index in devices:
        gpu = profile.gpus[index]
        if not gpu.known:
            notes.append(f"gpu:{index} '{gpu.name}' is not in the hardware data "
                         "(planner/profiles.json, matched by exact model name): its times use "
                         "stand-in rates and are guesses")
    return notes


# kept for callers of the old module layout
_dit_fixed_bytes = dit_fixed_bytes
