"""The placement plan: where each component goes, what each GPU peaks at, and why.

`plan_job(PlanRequest(...))` is the single source of truth the nodes, the CLI and the features
read: device placement (text encoder, VAEs and upscaler on the helper GPU0; DiT and sampler on
the root GPU1), whether Dual-Sage pays off and its head split, FFN/QKV chunk sizes, how many DiT
blocks stay resident and how many stream from pinned host memory, and the predicted peak and
headroom per GPU per phase. A job that cannot fit is reported with the smallest change that fits.

Residency, streaming and peaks follow the loader that runs (`loader`): ComfyUI's DynamicVRAM
(NVIDIA, ROCm 7.14+: its VBAR keeps what fits, the rest is cast in each step with its one-block
prefetch, its own pins), or the legacy loader, where the pack's streamer streams K blocks ahead
from host copies pinned within the budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from .. import geometry
from ..dual_sage import sizing as dual_sage_sizing
from ..offload import sizing as offload_sizing
from . import timing
from .components import OFFICIAL, ComponentSizes, bf16_sizes, dit_sizes_from_file
from .decode import DecodePlan, plan_decode
from .hardware import GiB, HardwareProfile, detect_hardware, get_profile
from .memory import BlockDims, ChunkSettings, block_activation_peak, choose_chunks
from .parallel import MODES as PARALLEL_MODES
from .parallel import ParallelPlan, plan_parallel
from .residency import (
    RESIDENT_NEEDS_LEGACY,
    LoaderPlan,
    PrefetchPlan,
    plan_loader,
    plan_prefetch,
)

TURBO_LORA_RANK = 128  # the rank of the built-in LoRA size (the 8-step turbo LoRA)
TEXT_ENCODER_WORKSPACE = int(0.75 * GiB)


@dataclass(frozen=True)
class PlanRequest:
    width: int = 1312  # PASS2 canvas
    height: int = 736
    seconds: float | None = 5.0
    frames: int | None = None  # overrides seconds when given (must be on the 17k+5 grid)
    pass1_width: int = 864
    pass1_height: int = 480
    profile: str | HardwareProfile = "auto"
    text_tokens: int = 256
    lora_rank: int = 128  # on-activation LoRA (the turbo LoRA); 0 = none
    dit_dtype: str = "int8"  # "int8" (official pruned file) or "bf16"
    dit_file: str | None = None  # read real block sizes from this checkpoint's header
    dual_sage: str = "auto"  # "auto" | "on" | "off"
    parallel: str = "auto"  # per pass: "auto" | "sequence" | "heads" | "off"
    decode: str = "auto"  # video decode on several GPUs: "auto" | "on" | "off"
    chunking: str = "auto"  # "auto" | "off" | "on"
    resident_blocks: int | None = None  # None = as many as fit
    fused_swiglu: bool = False  # ComfyUI's linear_input_act; the twin materialises silu
    quantized_attention: bool = False  # INT8-QK attention backend (ck_int8, triton_sage)
    pinned_fraction: float = 0.5  # share of host RAM the pinned arena may take
    # ComfyUI's DynamicVRAM loader: "auto" (on for NVIDIA, ROCm 7.14+), "on" or "off" (the
    # legacy loader: ROCm below 7.14, --disable-dynamic-vram, --highvram, --gpu-only, ...)
    dynamic_vram: str = "auto"
    # page-lockable host memory: ComfyUI's pin budget inside ComfyUI (MAX_PINNED_MEMORY); None
    # = pinned_fraction of the profile's RAM
    pinned_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        # numpy integers (a width read from an array) are accepted and stored as ints
        for name in ("width", "height", "pass1_width", "pass1_height", "text_tokens",
                     "lora_rank"):
            object.__setattr__(self, name, geometry.as_int(getattr(self, name), name))
        for name in ("frames", "resident_blocks"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, geometry.as_int(getattr(self, name), name))
        geometry.validate_two_pass(self.pass1_width, self.pass1_height, self.width, self.height)
        if self.frames is None and self.seconds is None:
            raise ValueError("give seconds or frames for the clip length")
        if self.frames is not None:
            geometry.validate_frames(self.frames)
        else:
            geometry.snap_frames(self.seconds)
        if self.dit_dtype not in ("int8", "bf16"):
            raise ValueError(f"dit_dtype {self.dit_dtype!r} is not known; use 'int8' or 'bf16'")
        for name in ("dual_sage", "chunking", "decode", "dynamic_vram"):
            value = getattr(self, name)
            allowed = ("auto", "on", "off")
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not valid; use one of {allowed}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={self.parallel!r} is not valid; use one of "
                             f"{PARALLEL_MODES}")
        for name, high, why in (
                ("lora_rank", geometry.HIDDEN, "the DiT's width; the turbo LoRA's rank is 128"),
                ("text_tokens", geometry.MAX_TEXT_TOKENS,
                 "far more than any prompt; H3 prompts take a few hundred tokens")):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (0 = none)")
            if value > high:
                raise ValueError(f"{name}={value} is larger than {high} ({why})")
        if self.resident_blocks is not None and not 0 <= self.resident_blocks <= geometry.BLOCKS:
            raise ValueError(f"resident_blocks={self.resident_blocks} must be between 0 and "
                             f"{geometry.BLOCKS}")
        if not (isinstance(self.pinned_fraction, (int, float))
                and 0.0 < self.pinned_fraction <= 0.9):
            raise ValueError(f"pinned_fraction={self.pinned_fraction} must be in (0, 0.9]")
        budget = self.pinned_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                   or budget < 0):
            raise ValueError(f"pinned_budget_bytes={budget!r} must be a byte count >= 0 (0 = "
                             "nothing pinned) or None (pinned_fraction of the host RAM)")
        if self.resident_blocks is not None and self.dynamic_vram == "on":
            raise ValueError(RESIDENT_NEEDS_LEGACY.format(n=self.resident_blocks, why="requested"))
        if self.dit_file is not None and not isinstance(self.dit_file, (str, os.PathLike)):
            raise ValueError(f"dit_file={self.dit_file!r} must be a path to a .safetensors file")

    @property
    def frame_count(self) -> int:
        return self.frames if self.frames is not None else geometry.snap_frames(self.seconds)


@dataclass(frozen=True)
class DualSagePlan:
    enabled: bool
    helper_devices: tuple[int, ...]
    split: tuple[int, ...]  # heads per device, root first
    min_tokens: int
    transport: str  # "peer" | "host" | "none"
    reason: str


@dataclass(frozen=True)
class ChunkPlan:
    ffn_chunk: int
    qkv_chunk: int
    head_group: int
    reason: str


@dataclass
class PhaseMemory:
    weights: int
    activations: int
    workspace: int = 0

    @property
    def peak(self) -> int:
        return self.weights + self.activations + self.workspace


@dataclass
class GPUPlan:
    index: int
    role: str  # "root", "helper", "root+helper"
    name: str
    capacity_bytes: int
    reserve_bytes: int  # fragmentation margin + runtime context, kept free
    phases: dict[str, PhaseMemory] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return max((p.peak for p in self.phases.values()), default=0)

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.reserve_bytes - self.peak_bytes


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
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    parallel: ParallelPlan | None = None
    decode: DecodePlan | None = None
    loader: LoaderPlan | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens(self) -> int:
        return self.pass2.tokens

    def report(self) -> str:
        from .report import render_report

        return render_report(self)

    def to_dict(self) -> dict:
        from .report import plan_to_dict

        return plan_to_dict(self)


def reserve_bytes(capacity: int) -> int:
    """Kept free on every GPU: allocator fragmentation and the runtime's own context."""
    return int(0.4 * GiB + 0.04 * capacity)


def _resolve_profile(profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    return detect_hardware() if profile == "auto" else get_profile(profile)


def _sizes(request: PlanRequest) -> ComponentSizes:
    sizes = bf16_sizes(OFFICIAL) if request.dit_dtype == "bf16" else OFFICIAL
    if request.dit_file:
        sizes = dit_sizes_from_file(request.dit_file, sizes)
    # LoRA weights scale with the rank: the built-in size is the turbo LoRA's, at rank 128
    sizes = replace(sizes, lora_bytes=sizes.lora_bytes * request.lora_rank // TURBO_LORA_RANK)
    return sizes


def plan_job(request: PlanRequest, *, suggest: bool = True) -> Plan:
    """Plan one two-pass job; raises ValueError for invalid input (nothing is loaded).

    A job that does not fit gets `suggestions` (set `suggest=False` to skip that search).
    """
    profile = _resolve_profile(request.profile)
    loader = plan_loader(request, profile)
    sizes = _sizes(request)
    frames = request.frame_count
    pass1 = geometry.PassGeometry(request.pass1_width, request.pass1_height, frames)
    pass2 = geometry.PassGeometry(request.width, request.height, frames)
    tokens = {"pass1": pass1.tokens + request.text_tokens,
              "pass2": pass2.tokens + request.text_tokens}
    dims = BlockDims(element_bytes=2)
    multi = profile.gpu_count >= 2
    root = 1 if multi else 0  # GPU0 hosts the text encoder, VAEs and upscaler: the DiT gets GPU1
    helpers = [i for i in range(profile.gpu_count) if i != root]

    # 1. Dual-Sage: does sharding heads over the link pay off at PASS2's length?
    dual = _plan_dual_sage(request, profile, root, helpers, tokens["pass2"])
    layout = _plan_root(request, profile, sizes, dims, tokens, dual, root, helpers, pass1, pass2,
                        loader)
    if dual.enabled and request.dual_sage == "auto" and not _root_fits(layout, root):
        # the root-side gather buffer of the helper heads is what tips it over: go without
        dual = replace(_DUAL_OFF, min_tokens=dual.min_tokens, reason=(
            "would not leave room on the root GPU for the helper heads' q/k/v gather buffer"))
        layout = _plan_root(request, profile, sizes, dims, tokens, dual, root, helpers, pass1,
                            pass2, loader)
    chunks, chunk_reason, prefetch, gpus, notes = layout
    placement = {"text_encoder": helpers[0] if multi else root,
                 "video_vae": helpers[0] if multi else root,
                 "audio_vae": helpers[0] if multi else root,
                 "latent_upscaler": helpers[0] if multi else root,
                 "dit": root, "sampler": root}

    # 2. Time per step, with and without the multi-GPU features.
    step, single = {}, {}
    q = request.quantized_attention
    for name, s in tokens.items():
        step[name] = _step_time(s, profile, root, helpers, dual, prefetch, sizes, q)
        single[name] = _step_time(s, profile, root, [], _DUAL_OFF, prefetch, sizes, q)

    # 3. Per pass: sequence parallel, Dual-Sage or one GPU, by predicted step time.
    parallel = _plan_parallel(request, profile, sizes, tokens, dual, prefetch, root, helpers,
                              step, single, chunks)
    _apply_parallel(parallel, gpus, root, helpers, step, notes)

    plan = Plan(request, profile, sizes, pass1, pass2, root, helpers, placement, dual,
                ChunkPlan(chunks.ffn_chunk, chunks.qkv_chunk, chunks.head_group, chunk_reason),
                prefetch, gpus, step, single, notes, parallel=parallel, loader=loader)
    plan.notes.extend(_range_notes(request, profile, pass1, pass2, root, helpers))
    # 4. The video decode: the VAE's GPU alone, or its windows shared with the other GPUs.
    plan.decode = _plan_decode(plan)
    _check_fit(plan, suggest)
    return plan


def _plan_parallel(request, profile, sizes, tokens, dual, prefetch, root, helpers, step, single,
                   chunks) -> ParallelPlan:
    helper_free = 0
    if helpers:
        spec = profile.gpus[helpers[0]]
        # ComfyUI keeps the VAEs and the upscaler loaded on the helper between passes
        helper_free = (spec.memory_bytes - reserve_bytes(spec.memory_bytes) - sizes.vae_bytes
                       - sizes.upscaler_bytes)
    requested = request.parallel
    if request.dual_sage == "off" and requested == "heads":
        requested = "off"
    return plan_parallel(
        requested=requested, profile=profile, root=root, helpers=helpers, tokens=tokens,
        single_step_s=single, heads_step_s=step,
        heads_active={n: dual.enabled and tokens[n] >= dual.min_tokens for n in tokens},
        block_bytes=sizes.dit_block_bytes, helper_free_bytes=helper_free,
        streamed_root_blocks=prefetch.streamed_blocks,
        root_block_copy_s=timing.block_copy_time_s(sizes.dit_block_bytes, profile.link,
                                                    pinned=prefetch.source == "pinned"),
        lora_rank=request.lora_rank, fused_swiglu=request.fused_swiglu,
        quantized=request.quantized_attention, ffn_chunk=chunks.ffn_chunk)


def _apply_parallel(parallel: ParallelPlan, gpus: list[GPUPlan], root: int, helpers: list[int],
                    step: dict[str, float], notes: list[str]) -> None:
    """Step times and per-GPU memory of the passes that run sequence-parallel."""
    for name, choice in parallel.passes.items():
        step[name] = choice.step_time_s
        if choice.mode != "sequence":
            continue
        label = "PASS1" if name == "pass1" else "PASS2"
        root_phase = gpus[root].phases[label]
        gpus[root].phases[label] = PhaseMemory(root_phase.weights, choice.root_activation_bytes)
        for index in helpers:
            phases = gpus[index].phases
            resident = phases[label].weights if label in phases else 0
            phases[label] = PhaseMemory(resident + choice.helper_weight_bytes,
                                        choice.helper_activation_bytes)
        notes.append(f"{label} sequence parallel: each GPU holds about half the activations "
                     f"(root {choice.root_activation_bytes / GiB:.1f} GiB, helper "
                     f"{choice.helper_activation_bytes / GiB:.1f} GiB), DiT on the helper as a "
                     f"{choice.helper_weights}")


def _range_notes(request: PlanRequest, profile: HardwareProfile, pass1, pass2, root: int,
                 helpers: list[int]) -> list[str]:
    """What the plan accepts but the user should know: untrained sizes, a missing kernel."""
    notes = [w for w in (geometry.canvas_warning(pass1.width, pass1.height, "PASS1"),
                         geometry.canvas_warning(pass2.width, pass2.height, "PASS2"),
                         geometry.frames_warning(pass2.frames)) if w]
    if request.quantized_attention:
        for index in [root, *helpers]:
            gpu = profile.gpus[index]
            if not gpu.int8_attention_tflops:
                notes.append(f"quantized attention: gpu:{index} ({gpu.name}) has no INT8 "
                             f"attention kernel; its attention is timed at the "
                             f"{gpu.compute_dtype} rate")
    return notes


def _plan_root(request, profile, sizes, dims, tokens, dual, root, helpers, pass1, pass2,
               loader):
    """Chunking and residency on the root GPU from what is left after the fixed weights."""
    root_gpu = profile.gpus[root]
    lora = request.lora_rank > 0
    # Dual-Sage's contiguous send/receive buffers for the helper heads, per token
    root_extra = (dual_sage_sizing.root_extra_bytes(1, sum(dual.split[1:]), dims.head_dim,
                                                    element_bytes=dims.element_bytes)
                  if dual.enabled else 0)
    reserve = reserve_bytes(root_gpu.memory_bytes)
    # the token refiner's blocks count with the DiT blocks: they stream with them
    fixed = _dit_fixed_bytes(sizes) + sizes.lora_bytes
    budget = root_gpu.memory_bytes - reserve - fixed
    all_blocks = (geometry.BLOCKS + geometry.REFINER_BLOCKS) * sizes.dit_block_bytes
    peak_kwargs = dict(lora_on_activations=lora, lora_rank=request.lora_rank,
                       fused_swiglu=request.fused_swiglu,
                       dual_sage_root_extra_per_token=root_extra)
    chunks, chunk_reason = _plan_chunks(request, dims, tokens["pass2"], budget - all_blocks,
                                        peak_kwargs)
    act = {p: block_activation_peak(tokens[p], dims, chunks, **peak_kwargs) for p in tokens}
    prefetch = plan_prefetch(request, sizes, budget - act["pass2"].peak_bytes, loader, root)
    notes: list[str] = []
    gpus = _gpu_plans(profile, sizes, root, helpers, act, prefetch, dual, tokens, pass1, pass2,
                      notes)
    return chunks, chunk_reason, prefetch, gpus, notes


def _root_fits(layout, root: int) -> bool:
    g = layout[3][root]
    return all(m.peak <= g.capacity_bytes - g.reserve_bytes for m in g.phases.values())


_DUAL_OFF = DualSagePlan(False, (), (geometry.HEADS,), 0, "none", "single GPU")


def _plan_dual_sage(request: PlanRequest, profile: HardwareProfile, root: int,
                    helpers: list[int], tokens: int) -> DualSagePlan:
    if not helpers:
        return DualSagePlan(False, (), (geometry.HEADS,), 0, "none",
                            "one GPU: nothing to shard onto")
    if request.dual_sage == "off":
        return DualSagePlan(False, (), (geometry.HEADS,), 0, "none", "switched off")
    gpus = [profile.gpus[root]] + [profile.gpus[h] for h in helpers]
    split = timing.split_heads_by_throughput(gpus)
    transport = "peer" if profile.link.peer_access else "host"
    q = request.quantized_attention
    single = timing.attention_time_s(tokens, gpus[0], quantized=q)
    sharded = timing.dual_sage_attention_time_s(tokens, gpus[0], gpus[1:], profile.link, split,
                                                quantized=q)
    gain = single / sharded
    min_tokens = timing.choose_min_tokens(gpus[0], gpus[1:], profile.link, split)
    link = f"{transport} link at {profile.link.helper_gbs:.0f} GB/s"
    if request.dual_sage == "on" or gain >= 1.03:
        return DualSagePlan(True, tuple(helpers), split, min_tokens, transport,
                            f"attention {gain:.2f}x faster at {tokens:,} tokens over the {link}; "
                            f"calls below {min_tokens:,} tokens stay on the root")
    return DualSagePlan(False, (), (geometry.HEADS,), min_tokens, transport,
                        f"would run attention at only {gain:.2f}x over the {link}")


def _plan_chunks(request: PlanRequest, dims: BlockDims, tokens: int, free_for_acts: int,
                 peak_kwargs: dict) -> tuple[ChunkSettings, str]:
    plain = block_activation_peak(tokens, dims, **peak_kwargs)
    if request.chunking == "off":
        return ChunkSettings(), "switched off"
    if request.chunking == "on":
        chunked = choose_chunks(0, tokens, dims, **peak_kwargs)
        return chunked, "forced on"
    if plain.peak_bytes <= free_for_acts:
        return ChunkSettings(), (f"not needed: the unchunked peak "
                                 f"{plain.peak_bytes / GiB:.1f} GiB fits beside all blocks")
    chunked = choose_chunks(max(free_for_acts, 0), tokens, dims, **peak_kwargs)
    after = block_activation_peak(tokens, dims, chunked, **peak_kwargs)
    note = _chunk_note(request, dims, chunked)
    return chunked, (f"caps the {plain.phase} peak {plain.peak_bytes / GiB:.1f} -> "
                     f"{after.peak_bytes / GiB:.1f} GiB (row chunking: {note})")


def _chunk_note(request: PlanRequest, dims: BlockDims, chunks: ChunkSettings) -> str:
    """'exact', or why not: the measured row floors of the on-activation LoRA's GEMMs."""
    from ..chunking import sizing as block_sizing

    adapters = block_sizing.Adapters.turbo_lora(request.lora_rank)
    floors = block_sizing.planned_floors(dims, adapters)
    return block_sizing.exactness_note(chunks.ffn_chunk, chunks.qkv_chunk, chunks.head_group,
                                       floors)


def _dit_fixed_bytes(sizes: ComponentSizes) -> int:
    """DiT bytes always resident: outside the 50 blocks and the token refiner's blocks."""
    return max(0, sizes.dit_other_bytes - geometry.REFINER_BLOCKS * sizes.dit_block_bytes)


def _gpu_plans(profile, sizes, root, helpers, act, prefetch, dual, tokens, pass1, pass2,
               notes):
    from .sizing import dual_sage_helper_workspace, upscale_workspace

    gpus = []
    # resident blocks plus the block-sized buffers of whoever streams (the pack's K + 1 slots,
    # or DynamicVRAM's running and next-staged block)
    dit_weights = _dit_fixed_bytes(sizes) + sizes.lora_bytes + \
        offload_sizing.streamed_weight_vram_bytes(
            blocks=geometry.BLOCKS, resident=prefetch.resident_blocks,
            block_bytes=sizes.dit_block_bytes, lookahead=max(prefetch.lookahead, 1),
            extra_streamed=geometry.REFINER_BLOCKS)
    for index, spec in enumerate(profile.gpus):
        is_root, is_helper = index == root, index in helpers or not helpers
        role = "root+helper" if is_root and not helpers else ("root" if is_root else "helper")
        g = GPUPlan(index, role, spec.describe(), spec.memory_bytes,
                    reserve_bytes(spec.memory_bytes))
        helper_side = (not helpers and is_root) or (helpers and index == helpers[0])
        if helper_side:
            usable = spec.memory_bytes - g.reserve_bytes
            # ComfyUI loads what fits and runs the rest of the text encoder from CPU memory
            te_on_gpu = min(sizes.text_encoder_bytes, usable - TEXT_ENCODER_WORKSPACE)
            if te_on_gpu < sizes.text_encoder_bytes:
                notes.append(f"text encoder: {(sizes.text_encoder_bytes - te_on_gpu) / GiB:.1f} "
                             f"GiB of its weights stay in CPU memory (ComfyUI partial loading; "
                             f"slower prompt encoding, once per prompt)")
            g.phases["text encode"] = PhaseMemory(max(te_on_gpu, 0), TEXT_ENCODER_WORKSPACE)
            g.phases["latent upscale"] = PhaseMemory(
                sizes.upscaler_bytes, upscale_workspace(pass1, pass2))
            # set by _plan_decode once the decode's devices are known (measured numbers)
            g.phases["decode"] = PhaseMemory(sizes.vae_bytes, 0)
        for name, s in tokens.items():
            label = "PASS1" if name == "pass1" else "PASS2"
            if is_root:
                g.phases[label] = PhaseMemory(dit_weights, act[name].peak_bytes)
            elif dual.enabled and is_helper:
                share = dual.split[1 + helpers.index(index)]
                resident = sizes.vae_bytes + sizes.upscaler_bytes
                g.phases[label] = PhaseMemory(resident, 0, dual_sage_helper_workspace(
                    s, share, host_relay=not profile.link.peer_access))
        gpus.append(g)
    return gpus


def _plan_decode(plan: Plan) -> DecodePlan:
    """Decode devices and their decode-phase memory (the VAE GPU's phase is replaced, each
    helper that takes windows gets one: what it keeps there plus its decoder copy)."""
    vae_gpu = plan.placement["video_vae"]
    others = [g.index for g in plan.gpus if g.index != vae_gpu]
    usable = {g.index: g.capacity_bytes - g.reserve_bytes for g in plan.gpus}
    # the DiT's GPU still holds its resident weights when decoding starts
    held = {g.index: g.phases["PASS2"].weights for g in plan.gpus
            if g.index == plan.root_device and g.index != vae_gpu and "PASS2" in g.phases}
    element = 2  # the VAE runs in fp16/bf16 on a GPU
    decode = plan_decode(plan.profile, vae_gpu=vae_gpu, helpers=others,
                         width=plan.pass2.width, height=plan.pass2.height,
                         frames=plan.pass2.frames, vae_bytes=plan.sizes.video_vae_bytes,
                         usable_bytes=usable, held_bytes=held, mode=plan.request.decode,
                         element_bytes=element)
    by_index = {g.index: g for g in plan.gpus}
    for index, (weights, activations) in decode.memory.items():
        if index == vae_gpu:  # both VAEs stay loaded; the video decode's windows on top
            weights = plan.sizes.vae_bytes
        elif not decode.make_room:
            weights += held.get(index, 0)
        by_index[index].phases["decode"] = PhaseMemory(weights, activations)
    return decode


def _step_time(tokens, profile, root, helpers, dual, prefetch, sizes, quantized) -> float:
    root_gpu = profile.gpus[root]
    linear = timing.linear_time_s(tokens, root_gpu)
    if dual.enabled and helpers and tokens >= dual.min_tokens:
        attention = timing.dual_sage_attention_time_s(
            tokens, root_gpu, [profile.gpus[h] for h in helpers], profile.link, dual.split,
            quantized=quantized)
    else:
        attention = timing.attention_time_s(tokens, root_gpu, quantized=quantized)
    block = linear + attention
    copy = timing.block_copy_time_s(sizes.dit_block_bytes, profile.link,
                                    pinned=prefetch.source == "pinned")
    if prefetch.streamer == "comfyui":
        # DynamicVRAM stages one block ahead: each copy hides behind one block's compute
        overhead = offload_sizing.one_ahead_overhead_seconds(
            streamed=prefetch.streamed_blocks, block_compute_s=block, block_copy_s=copy)
    else:
        # resident blocks are spread among streamed ones, giving each copy more compute to
        # hide in
        overhead = offload_sizing.step_overhead_seconds(
            blocks=geometry.BLOCKS, streamed=prefetch.streamed_blocks, block_compute_s=block,
            block_copy_s=copy)
    return geometry.BLOCKS * block + overhead


def _check_fit(plan: Plan, suggest: bool) -> None:
    for g in plan.gpus:
        for phase, mem in g.phases.items():
            if mem.peak > g.capacity_bytes - g.reserve_bytes:
                plan.problems.append(
                    f"gpu:{g.index} {phase} needs {mem.peak / GiB:.1f} GiB of "
                    f"{(g.capacity_bytes - g.reserve_bytes) / GiB:.1f} GiB usable")
    if plan.problems and suggest:
        from .suggest import suggest_fixes

        plan.suggestions.extend(suggest_fixes(plan))
