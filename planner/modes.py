"""Stage 3 of a plan: the mode of each pass, each candidate planned with the memory it would have.

For each pass and each mode (one GPU, heads = Dual-Sage, sequence, and above CFG 1 ComfyUI's CFG
Split, `planner.cfg_split`) this module works out the
root's activation peak in that mode, the chunking that peak needs to sit beside all blocks, the
blocks that stay resident beside it, the helper's share and the step time that follows; a pass
then runs the fastest mode that fits (never one slower than the root alone by the margin).
Memory and chunking for the whole model are decided afterwards from the modes that run
(`planner.layout`): a one-GPU peak never sizes a pass that runs sequence parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunking import sizing as block_sizing
from ..common import geometry
from ..dual_sage import sizing as dual_sage_sizing
from ..offload import sizing as offload_sizing
from ..sequence import sizing as sequence_sizing
from . import cfg_split, timing, two_by_two
from .attention import AttentionChoice
from .components import ComponentSizes
from .hardware import GiB, HardwareProfile
from .heads import DualSageSetup, heads_available
from .memory import BlockDims, ChunkSettings, block_activation_peak
from .parallel import EXACT_MIN_ROWS, MARGIN, ParallelPlan, PassParallel
from .placement import Placement
from .request import PlanRequest
from .residency import LoaderPlan, PrefetchPlan, plan_prefetch
from .sizing import dual_sage_helper_workspace

MIN_SPARE_BYTES = int(0.5 * GiB)  # left free beyond the reserve when streaming can give it
CHUNK_ROWS = (32768, 16384, 8192, 4096)  # large chunks keep the GEMMs efficient
LABELS = {"pass1": "PASS1", "pass2": "PASS2"}
MODE_ORDER = ("off", "heads", "sequence", "cfg", two_by_two.MODE)


@dataclass(frozen=True, kw_only=True)
class DiTContext:
    """What every pass and mode is planned against (built once per plan)."""

    request: PlanRequest
    profile: HardwareProfile
    placement: Placement
    sizes: ComponentSizes
    loader: LoaderPlan
    attention: AttentionChoice
    rates: tuple[timing.GPURates, ...]  # per GPU index
    dims: BlockDims
    kernels: block_sizing.Kernels  # the block's kernels, as the run reads them (`Kernels.of`)
    dual: DualSageSetup
    shapes: dict[str, geometry.PassGeometry]  # per pass: canvas, frames, latent
    tokens: dict[str, int]  # per pass, text included

    @property
    def root(self) -> int:
        return self.placement.root

    @property
    def helpers(self) -> list[int]:
        return list(self.placement.helpers)

    @property
    def fixed_bytes(self) -> int:
        """Root bytes that never stream: the DiT outside its blocks, and the LoRA."""
        return dit_fixed_bytes(self.sizes) + self.sizes.lora_bytes

    @property
    def root_budget_bytes(self) -> int:
        """Root bytes for DiT blocks and activations."""
        return self.placement.usable_bytes[self.root] - self.fixed_bytes

    @property
    def all_blocks_bytes(self) -> int:
        # the token refiner's blocks count with the DiT blocks: they stream with them
        return (geometry.BLOCKS + geometry.REFINER_BLOCKS) * self.sizes.dit_block_bytes

    @property
    def row_weights(self) -> tuple[float, ...]:
        rates = tuple(self.rates[i].gemm_tflops for i in [self.root, *self.helpers])
        return rates if len(set(rates)) > 1 else (1.0,) * len(rates)

    @property
    def seq_heads(self) -> tuple[int, ...]:
        return tuple(sequence_sizing.split_counts(geometry.HEADS, self.row_weights))


def dit_fixed_bytes(sizes: ComponentSizes) -> int:
    """DiT bytes always resident: outside the 50 blocks and the token refiner's blocks."""
    return max(0, sizes.dit_other_bytes - geometry.REFINER_BLOCKS * sizes.dit_block_bytes)


@dataclass(frozen=True, kw_only=True)
class PassMemory:
    """One pass in one mode: the activations and the helper's share."""

    mode: str
    chunks: ChunkSettings
    root_activation_bytes: int
    phase: str  # where the root's peak is: "attention/QKV" | "FFN" | "sequence block"
    helper_activation_bytes: int = 0
    helper_dit_bytes: int = 0  # sequence: the DiT replica or its streaming slots
    helper_workspace_bytes: int = 0  # heads: Dual-Sage's ring of head chunks
    helper_weights: str = "none"  # "replica" | "stream" | "none"
    refusal: str | None = None  # why the mode cannot run this pass


@dataclass(frozen=True, kw_only=True)
class ModeOption:
    memory: PassMemory
    prefetch: PrefetchPlan
    step: timing.StepTime
    shortfall_bytes: int  # how far the fullest GPU is over its usable memory (0: it fits)

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0 and self.memory.refusal is None


@dataclass(frozen=True, kw_only=True)
class ModeDecision:
    """Stage output: the mode of each pass, with the option it was chosen from."""

    parallel: ParallelPlan
    chosen: dict[str, ModeOption]
    single: dict[str, ModeOption]  # each pass on the root GPU alone


# ------------------------------------------------------------------ memory of a pass in a mode
def _adapter_kwargs(ctx: DiTContext) -> dict:
    return dict(lora_on_activations=ctx.request.lora_rank > 0, lora_rank=ctx.request.lora_rank,
                kernels=ctx.kernels)


def pass_memory(ctx: DiTContext, *, mode: str, tokens: int, chunks: ChunkSettings,
                helper_weights: str | None = None) -> PassMemory:
    """The activations of one pass in `mode` with `chunks`, and what the helper holds
    (sequence mode: `helper_weights` "stream" forces streaming, None lets it choose)."""
    if mode == "sequence":
        return _sequence_memory(ctx, tokens, chunks, helper_weights)
    if mode == "cfg":
        return cfg_split.cfg_memory(ctx, tokens, chunks, helper_weights)
    if mode == two_by_two.MODE:
        return two_by_two.memory(ctx, tokens)
    extra = 0
    workspace = 0
    if mode == "heads":
        # Dual-Sage's contiguous send/receive buffers for the helper heads, per token
        extra = dual_sage_sizing.root_extra_bytes(1, sum(ctx.dual.split[1:]), ctx.dims.head_dim,
                                                  element_bytes=ctx.dims.element_bytes)
        workspace = dual_sage_helper_workspace(tokens, ctx.dual.split[1],
                                               host_relay=not ctx.profile.link.peer_access)
    peak = block_activation_peak(tokens, ctx.dims, chunks, dual_sage_root_extra_per_token=extra,
                                 **_adapter_kwargs(ctx))
    return PassMemory(mode=mode, chunks=chunks, root_activation_bytes=peak.peak_bytes,
                      phase=peak.phase, helper_workspace_bytes=workspace)


def _sequence_memory(ctx: DiTContext, tokens: int, chunks: ChunkSettings,
                     helper_weights: str | None) -> PassMemory:
    adapters = block_sizing.Adapters.turbo_lora(ctx.request.lora_rank)
    memory = sequence_sizing.sequence_memory(
        tokens, ctx.seq_heads, row_weights=ctx.row_weights, adapters=adapters, kernels=ctx.kernels,
        ffn_chunk=chunks.ffn_chunk)
    helper_act = max(m.peak for m in memory[1:])
    shares = sequence_sizing.split_counts(tokens, ctx.row_weights)
    refusal = None
    if min(shares) < EXACT_MIN_ROWS:
        refusal = (f"{tokens:,} tokens give a GPU {min(shares):,} rows, below the exact range "
                   f"({EXACT_MIN_ROWS:,})")
    block = ctx.sizes.dit_block_bytes
    replica = geometry.BLOCKS * block
    slots = sequence_sizing.helper_weight_bytes(block, geometry.BLOCKS, replica=False)
    free = ctx.placement.helper_free_bytes
    if helper_weights != "stream" and replica + helper_act + MIN_SPARE_BYTES <= free:
        weights, dit = "replica", replica
    elif slots + helper_act <= free:
        weights, dit = "stream", slots
    else:
        weights, dit = "none", 0
        refusal = refusal or (f"the helper cannot hold {helper_act / GiB:.1f} GiB of "
                              f"activations beside the DiT's streaming slots")
    return PassMemory(mode="sequence", chunks=chunks, root_activation_bytes=memory[0].peak,
                      phase="sequence block", helper_activation_bytes=helper_act,
                      helper_dit_bytes=dit, helper_weights=weights, refusal=refusal)


def needed_chunks(ctx: DiTContext, *, mode: str, tokens: int) -> ChunkSettings:
    """The cheapest chunking whose root peak in `mode` sits beside every DiT block (the most
    aggressive when none does); none when switched off, the smallest when forced on."""
    if ctx.request.chunking == "off":
        return ChunkSettings()
    ladder = [ChunkSettings(ffn_chunk=rows, qkv_chunk=rows,
                            head_group=ctx.dims.heads // 4 or 1) for rows in CHUNK_ROWS]
    if ctx.request.chunking == "on":
        return ladder[-1]
    free = ctx.root_budget_bytes - ctx.all_blocks_bytes
    for chunks in [ChunkSettings(), *ladder]:
        if pass_memory(ctx, mode=mode, tokens=tokens, chunks=chunks).root_activation_bytes \
                <= free:
            return chunks
    return ladder[-1]  # even this does not fit beside all blocks: blocks stream


def free_for_blocks(ctx: DiTContext, root_activation_bytes: int) -> int:
    """Root bytes left for DiT block weights beside the activations (and the spare)."""
    return ctx.root_budget_bytes - root_activation_bytes - MIN_SPARE_BYTES


def pass_step(ctx: DiTContext, *, mode: str, tokens: int, prefetch: PrefetchPlan,
              helper_weights: str, calls: int = 1) -> timing.StepTime:
    """One step of one pass in `mode` with this residency on the root; `calls` model calls a
    step (2 above CFG 1), one after the other except in CFG Split's mode."""
    if mode == "cfg":
        return cfg_split.cfg_step(ctx, tokens=tokens, prefetch=prefetch,
                                  helper_weights=helper_weights)
    if mode == two_by_two.MODE:
        return two_by_two.step(ctx, tokens=tokens, prefetch=prefetch)
    root = ctx.rates[ctx.root]
    helpers = [ctx.rates[h] for h in ctx.helpers]
    link = ctx.profile.link
    if mode == "sequence":
        streamed = ctx.sizes.dit_block_bytes if helper_weights == "stream" else 0
        block = timing.sequence_block_s(tokens, [root, *helpers], ctx.seq_heads, link,
                                        row_weights=ctx.row_weights,
                                        helper_streamed_block_bytes=streamed)
    elif mode == "heads":
        block = timing.heads_block_s(tokens, root, helpers, link, ctx.dual.split)
    else:
        block = timing.one_gpu_block_s(tokens, root)
    copy = timing.block_copy_s(ctx.sizes.dit_block_bytes, link,
                               pinned_fraction=prefetch.pinned_fraction)
    overhead = timing.streaming_s(comfy_streams=prefetch.streamer == "comfyui",
                                  streamed=prefetch.streamed_blocks, block_s=block, copy_s=copy)
    return timing.StepTime(mode=mode, block_s=block, streaming_s=overhead, calls=calls)


def root_need_bytes(ctx: DiTContext, memory: PassMemory, prefetch: PrefetchPlan) -> int:
    """The root's peak in this pass: fixed weights, block weights (resident and the buffers of
    whoever streams) and the activations."""
    return ctx.fixed_bytes + block_weight_bytes(ctx, prefetch) + memory.root_activation_bytes


def block_weight_bytes(ctx: DiTContext, prefetch: PrefetchPlan) -> int:
    # resident blocks plus the block-sized buffers of whoever streams (the pack's K + 1 slots,
    # or DynamicVRAM's running and next-staged block)
    return offload_sizing.streamed_weight_vram_bytes(
        blocks=geometry.BLOCKS, resident=prefetch.resident_blocks,
        block_bytes=ctx.sizes.dit_block_bytes, lookahead=max(prefetch.lookahead, 1),
        extra_streamed=geometry.REFINER_BLOCKS)


def option(ctx: DiTContext, *, mode: str, tokens: int, calls: int = 1) -> ModeOption:
    """One pass in one mode, with the chunking and residency that mode would have alone."""
    # CFG Split's clones run no pack chunking: its pass is planned unchunked
    chunks = ChunkSettings() if mode in cfg_split.CFG_MODES else \
        needed_chunks(ctx, mode=mode, tokens=tokens)
    memory = pass_memory(ctx, mode=mode, tokens=tokens, chunks=chunks)
    prefetch = plan_prefetch(ctx.request, ctx.sizes,
                             free_for_blocks(ctx, memory.root_activation_bytes), ctx.loader,
                             ctx.root)
    if mode in cfg_split.CFG_MODES:
        memory = cfg_split.with_root_refusal(memory, prefetch)
    short = max(0, root_need_bytes(ctx, memory, prefetch) - ctx.placement.usable_bytes[ctx.root])
    if mode == "heads":
        helper = ctx.helpers[0]
        need = ctx.sizes.vae_bytes + ctx.sizes.upscaler_bytes + memory.helper_workspace_bytes
        short += max(0, need - ctx.placement.usable_bytes[helper])
    step = pass_step(ctx, mode=mode, tokens=tokens, prefetch=prefetch,
                     helper_weights=memory.helper_weights, calls=calls)
    return ModeOption(memory=memory, prefetch=prefetch, step=step, shortfall_bytes=short)


# ------------------------------------------------------------------ the choice per pass
def decide_modes(ctx: DiTContext) -> ModeDecision:
    passes, chosen, single = {}, {}, {}
    pools: dict[str, dict[str, ModeOption]] = {}
    picks, fallback, notes = {}, {}, {}
    for name, tokens in ctx.tokens.items():
        calls = ctx.request.model_calls(name)
        off = option(ctx, mode="off", tokens=tokens, calls=calls)
        single[name] = off
        options = {"off": off}
        pools[name] = options
        if not ctx.helpers:
            picks[name] = fallback[name] = "off"
            notes[name] = "one GPU"
            continue
        heads_why = heads_available(ctx, tokens)
        if heads_why is None:
            options["heads"] = option(ctx, mode="heads", tokens=tokens, calls=calls)
        sequence = option(ctx, mode="sequence", tokens=tokens, calls=calls)
        if sequence.memory.refusal is None:
            options["sequence"] = sequence
        cfg_why = cfg_split.AT_CFG_1
        if calls == 2:
            split = option(ctx, mode="cfg", tokens=tokens, calls=calls)
            cfg_why = split.memory.refusal
            if cfg_why is None:
                options["cfg"] = split
        why_not = {"sequence": sequence.memory.refusal, "heads": heads_why, "cfg": cfg_why}
        why_not[two_by_two.MODE] = two_by_two.unavailable(ctx, calls)
        if why_not[two_by_two.MODE] is None:
            pairs = option(ctx, mode=two_by_two.MODE, tokens=tokens, calls=calls)
            why_not[two_by_two.MODE] = pairs.memory.refusal
            if pairs.memory.refusal is None:
                options[two_by_two.MODE] = pairs
        picks[name], notes[name] = _choose(requested=ctx.request.parallel, options=options,
                                           why_not=why_not)
        fallback[name] = picks[name]
        if picks[name] in cfg_split.CFG_MODES:
            fallback[name], _ = _choose(
                requested=ctx.request.parallel,
                options={m: o for m, o in options.items() if m not in cfg_split.CFG_MODES},
                why_not={**why_not, **dict.fromkeys(cfg_split.CFG_MODES, "not taken")})
    steps = {"pass1": ctx.request.pass1_steps, "pass2": ctx.request.pass2_steps}
    job = cfg_split.resolve_job(picks, fallback, pools, steps)
    for name, mode in job.chosen.items():
        options = pools[name]
        why = notes[name] + (f"; {job.note}" if job.note and mode != picks[name] else "")
        chosen[name] = options[mode]
        times = {m: o.step.total_s for m, o in options.items()}
        passes[name] = _pass_parallel(choice=options[mode], off=single[name], why=why,
                                      times=times)
    heads = ctx.seq_heads if ctx.helpers else (geometry.HEADS,)
    transport = "none" if not ctx.helpers else ("peer" if ctx.profile.link.peer_access
                                                else "host")
    parallel = ParallelPlan(requested=ctx.request.parallel, row_weights=ctx.row_weights,
                            head_split=heads, transport=transport, passes=passes)
    return ModeDecision(parallel=parallel, chosen=chosen, single=single)


FORCED_WORDS = {"sequence": "sequence refused", "heads": "heads not available",
                "cfg": "CFG split not available", two_by_two.MODE: "2x2 not available"}


def _choose(*, requested: str, options: dict[str, ModeOption],
            why_not: dict[str, str | None]) -> tuple[str, str]:
    """The pass's mode and why: a forced mode where it can run (else the next best), else the
    fastest that fits, never a split one slower than one GPU by the margin."""
    if requested == "off":
        return "off", "switched off"
    if requested in FORCED_WORDS:
        if requested in options:
            return requested, "forced"
        # the next best of the same kind: heads for sequence, CFG split for the 2x2
        nearest = {"sequence": "heads", two_by_two.MODE: "cfg"}.get(requested)
        fallback = nearest if nearest in options else "off"
        return fallback, f"{FORCED_WORDS[requested]}: {why_not[requested]}"
    fitting = {m: o for m, o in options.items() if o.fits}
    pool = fitting or options
    if fitting:
        mode = min(pool, key=lambda m: pool[m].step.total_s)
        off = options["off"]
        if mode != "off" and off.fits and \
                off.step.total_s / pool[mode].step.total_s < MARGIN:
            mode = "off"
    else:  # nothing fits: the mode closest to fitting (the verdict says what to change)
        mode = min(pool, key=lambda m: (pool[m].shortfall_bytes, pool[m].step.total_s))
    words = ", ".join(f"{m} {options[m].step.total_s:.1f}" for m in MODE_ORDER if m in options)
    why = f"predicted {words} s/it"
    unfit = [m for m, o in options.items() if not o.fits]
    if unfit:
        why += "; " + ", ".join(f"{m} does not fit ({options[m].shortfall_bytes / GiB:.1f} GiB "
                                f"over)" for m in sorted(unfit))
    if not fitting:
        why += "; none fits: the closest"
    for name in ("sequence", "heads", "cfg", two_by_two.MODE):
        reason = why_not.get(name)
        # not said where the mode cannot apply at all (CFG 1; 2x2 below four GPUs)
        if reason is not None and name not in options and \
                reason not in (cfg_split.AT_CFG_1, two_by_two.NEEDS_FOUR):
            why += f"; {FORCED_WORDS[name]}: {reason}"
    return mode, why


def _pass_parallel(*, choice: ModeOption, off: ModeOption, why: str,
                   times: dict[str, float]) -> PassParallel:
    m = choice.memory
    step = choice.step.total_s
    return PassParallel(mode=m.mode, reason=why, step_time_s=step,
                        speedup=off.step.total_s / step, helper_weights=m.helper_weights,
                        root_activation_bytes=m.root_activation_bytes,
                        helper_activation_bytes=m.helper_activation_bytes,
                        helper_weight_bytes=m.helper_dit_bytes,
                        options_s={k: round(v, 2) for k, v in times.items()})
