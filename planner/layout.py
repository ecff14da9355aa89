"""Stage 4 of a plan: memory for the modes that run.

The chunking is the model's (one setting for both passes): the most aggressive any pass needs in
the mode it runs. The DiT blocks that stay resident on the root are what fits beside the larger
of the passes' activation peaks in their modes, with the spare kept. Then every GPU's phases:
the root's passes, the helper's share of a split pass, and the helper's own work (text encode,
latent upscale, video decode, the last from `planner.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import two_by_two
from .decode import DecodePlan, plan_decode
from .hardware import GiB
from .memory import ChunkSettings
from .modes import (
    CHUNK_ROWS,
    LABELS,
    MIN_SPARE_BYTES,
    DiTContext,
    ModeDecision,
    PassMemory,
    block_weight_bytes,
    free_for_blocks,
    pass_memory,
)
from .residency import PrefetchPlan, plan_prefetch
from .sizing import upscale_workspace

TEXT_ENCODER_WORKSPACE = int(0.75 * GiB)
MODE_WORDS = {"off": "one GPU", "heads": "Dual-Sage", "sequence": "sequence parallel",
              "cfg": "CFG split (ComfyUI's MultiGPU CFG Split)",
              two_by_two.MODE: two_by_two.WORDS}


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
    def usable_bytes(self) -> int:
        return self.capacity_bytes - self.reserve_bytes

    @property
    def peak_bytes(self) -> int:
        return max((p.peak for p in self.phases.values()), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].peak) if self.phases else "-"

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.peak_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """Stage output: chunking, residency and every GPU's phases for the modes that run."""

    chunking: ChunkPlan
    prefetch: PrefetchPlan
    passes: dict[str, PassMemory]
    gpus: list[GPUPlan]
    notes: list[str]


def _aggression(chunks: ChunkSettings) -> int:
    return CHUNK_ROWS.index(chunks.ffn_chunk) + 1 if chunks.ffn_chunk in CHUNK_ROWS else 0


def plan_memory(ctx: DiTContext, decision: ModeDecision) -> MemoryLayout:
    # 1. the model's chunking: the most aggressive any pass needs in the mode it runs
    needs = {name: option.memory for name, option in decision.chosen.items()}
    worst = max(needs, key=lambda n: (_aggression(needs[n].chunks),
                                      needs[n].root_activation_bytes))
    chunks = needs[worst].chunks
    # 2. each pass's memory with those chunks, and the blocks resident beside the larger peak
    # the sequence runtime builds the helper's DiT once (at its first split step) and keeps
    # it: one choice for both passes, streaming when any pass needs it
    # (CFG Split's clones are ComfyUI's: its loader sizes their residency at each pass)
    stream = any(m.mode == "sequence" and m.helper_weights == "stream" for m in needs.values())
    passes = {name: pass_memory(ctx, mode=m.mode, tokens=ctx.tokens[name], chunks=chunks,
                                helper_weights="stream" if stream and m.mode == "sequence"
                                else None)
              for name, m in needs.items()}
    peak_pass = max(passes, key=lambda n: passes[n].root_activation_bytes)
    prefetch = plan_prefetch(ctx.request, ctx.sizes,
                             free_for_blocks(ctx, passes[peak_pass].root_activation_bytes),
                             ctx.loader, ctx.root)
    reason = _chunk_reason(ctx, worst, needs[worst].mode, chunks, passes[peak_pass], peak_pass)
    notes: list[str] = []
    gpus = _gpu_plans(ctx, passes, prefetch, notes)
    return MemoryLayout(chunking=ChunkPlan(chunks.ffn_chunk, chunks.qkv_chunk, chunks.head_group,
                                           reason),
                        prefetch=prefetch, passes=passes, gpus=gpus, notes=notes)


def _chunk_reason(ctx: DiTContext, name: str, mode: str, chunks: ChunkSettings,
                  peak: PassMemory, peak_name: str) -> str:
    if ctx.request.chunking == "off":
        return "switched off"
    if ctx.request.chunking == "on":
        return "forced on"
    where = f"{LABELS[name]} ({MODE_WORDS[mode]})"
    if not chunks.active:
        return (f"not needed: the {LABELS[peak_name]} ({MODE_WORDS[peak.mode]}) root peak "
                f"{peak.root_activation_bytes / GiB:.1f} GiB fits beside all blocks")
    tokens = ctx.tokens[name]
    plain = pass_memory(ctx, mode=mode, tokens=tokens, chunks=ChunkSettings())
    after = pass_memory(ctx, mode=mode, tokens=tokens, chunks=chunks)
    return (f"caps the {where} {plain.phase} peak {plain.root_activation_bytes / GiB:.1f} -> "
            f"{after.root_activation_bytes / GiB:.1f} GiB on the root (row chunking: "
            f"{_chunk_note(ctx, chunks)})")


def _chunk_note(ctx: DiTContext, chunks: ChunkSettings) -> str:
    """'exact', or why not: the measured row floors of the on-activation LoRA's GEMMs."""
    from ..chunking import sizing as block_sizing

    adapters = block_sizing.Adapters.turbo_lora(ctx.request.lora_rank)
    floors = block_sizing.planned_floors(ctx.dims, adapters)
    return block_sizing.exactness_note(chunks.ffn_chunk, chunks.qkv_chunk, chunks.head_group,
                                       floors)


def _gpu_plans(ctx: DiTContext, passes: dict[str, PassMemory], prefetch: PrefetchPlan,
               notes: list[str]) -> list[GPUPlan]:
    from .placement import reserve_bytes

    placement, sizes = ctx.placement, ctx.sizes
    side = placement.helpers[0] if placement.helpers else placement.root
    dit_weights = ctx.fixed_bytes + block_weight_bytes(ctx, prefetch)
    gpus = []
    for index, spec in enumerate(ctx.profile.gpus):
        g = GPUPlan(index, placement.role(index), spec.describe(), spec.memory_bytes,
                    reserve_bytes(spec.memory_bytes))
        if index == side:
            usable = g.usable_bytes
            # ComfyUI loads what fits and runs the rest of the text encoder from CPU memory
            # (planned with the spare kept, so partial loading never reads as a tight fit)
            te_on_gpu = min(sizes.text_encoder_bytes,
                            usable - TEXT_ENCODER_WORKSPACE - MIN_SPARE_BYTES)
            if te_on_gpu < sizes.text_encoder_bytes:
                notes.append(f"text encoder: {(sizes.text_encoder_bytes - te_on_gpu) / GiB:.1f} "
                             f"GiB of its weights stay in CPU memory (ComfyUI partial loading; "
                             f"slower prompt encoding, once per prompt)")
            g.phases["text encode"] = PhaseMemory(max(te_on_gpu, 0), TEXT_ENCODER_WORKSPACE)
            g.phases["latent upscale"] = PhaseMemory(
                sizes.upscaler_bytes, upscale_workspace(ctx.shapes["pass1"],
                                                        ctx.shapes["pass2"]))
            # set by plan_decode_phase once the decode's devices are known (measured numbers)
            g.phases["decode"] = PhaseMemory(sizes.vae_bytes, 0)
        for name, memory in passes.items():
            label = LABELS[name]
            if index == placement.root:
                g.phases[label] = PhaseMemory(dit_weights, memory.root_activation_bytes)
                continue
            resident = sizes.vae_bytes + sizes.upscaler_bytes if index == side else 0
            if memory.mode == "heads":
                share = ctx.dual.split[1 + placement.helpers.index(index)]
                g.phases[label] = PhaseMemory(resident, 0, _helper_workspace(ctx, name, share))
            elif memory.mode == "sequence" or (memory.mode == "cfg" and index == side) or (
                    memory.mode == two_by_two.MODE
                    and index in two_by_two.sequence_helpers(placement.helpers)):
                # CFG Split's clone runs on core's first extra device, the first helper; in
                # 2x2 each of the three GPUs beside the root holds a whole DiT too
                g.phases[label] = PhaseMemory(resident + memory.helper_dit_bytes,
                                              memory.helper_activation_bytes)
        gpus.append(g)
    for name, memory in passes.items():
        if memory.mode == "sequence":
            notes.append(f"{LABELS[name]} sequence parallel: each GPU holds about half the "
                         f"activations (root {memory.root_activation_bytes / GiB:.1f} GiB, "
                         f"helper {memory.helper_activation_bytes / GiB:.1f} GiB), DiT on the "
                         f"helper as a {memory.helper_weights}")
    return gpus


def _helper_workspace(ctx: DiTContext, name: str, share: int) -> int:
    from .sizing import dual_sage_helper_workspace

    return dual_sage_helper_workspace(ctx.tokens[name], share,
                                      host_relay=not ctx.profile.link.peer_access)


def plan_decode_phase(ctx: DiTContext, gpus: list[GPUPlan]) -> DecodePlan:
    """Decode devices and their decode-phase memory (the VAE GPU's phase is replaced, each
    helper that takes windows gets one: what it keeps there plus its decoder copy)."""
    pass2 = ctx.shapes["pass2"]
    vae_gpu = ctx.placement.components["video_vae"]
    others = [g.index for g in gpus if g.index != vae_gpu]
    usable = {g.index: g.usable_bytes for g in gpus}
    # the DiT's GPU still holds its resident weights when decoding starts
    held = {g.index: g.phases["PASS2"].weights for g in gpus
            if g.index == ctx.root and g.index != vae_gpu and "PASS2" in g.phases}
    decode = plan_decode(ctx.profile, vae_gpu=vae_gpu, helpers=others, width=pass2.width,
                         height=pass2.height, frames=pass2.frames,
                         vae_bytes=ctx.sizes.video_vae_bytes, usable_bytes=usable,
                         held_bytes=held, mode=ctx.request.decode, element_bytes=2)
    by_index = {g.index: g for g in gpus}
    for index, (weights, activations) in decode.memory.items():
        if index == vae_gpu:  # both VAEs stay loaded; the video decode's windows on top
            weights = ctx.sizes.vae_bytes
        elif not decode.make_room:
            weights += held.get(index, 0)
        by_index[index].phases["decode"] = PhaseMemory(weights, activations)
    return decode
