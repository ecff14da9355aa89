"""Residency and streaming of the DiT blocks, for the loader ComfyUI runs the DiT with.

- ComfyUI's DynamicVRAM (NVIDIA; ROCm 7.14 and newer; torch 2.8+; main.py's rule): its VBAR on
  the root GPU keeps what fits beside the activations, the other blocks are cast in from host
  memory at every step with the next one staged while one runs (`make_prefetch_queue`), and
  ComfyUI pins the host copies within its own budget. The pack's streamer stands aside.
- The legacy loader (ROCm below 7.14, --disable-dynamic-vram / --highvram / --gpu-only /
  --novram, a ComfyUI without DynamicVRAM): the pack's streamer keeps the planned blocks
  resident and streams the rest K blocks ahead into K + 1 slots, from host copies pinned within
  the budget (past it through a pinned staging ring).
Both use offload/'s arithmetic (`offload.sizing`), so the plan and the runtime agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common import geometry
from ..offload import sizing as offload_sizing
from .components import ComponentSizes
from .hardware import GiB, HardwareProfile

if TYPE_CHECKING:
    from .request import PlanRequest

LOOKAHEAD = 2  # the pack's streamer: 2 streamed blocks ahead, into K + 1 = 3 device slots
COMFY_LOOKAHEAD = 1  # ComfyUI DynamicVRAM's make_prefetch_queue: the next block while one runs

RESIDENT_NEEDS_LEGACY = (
    "resident_blocks={n} sets the pack's block streamer, which runs only on ComfyUI's legacy "
    "loader, but DynamicVRAM is {why} (ComfyUI then decides what stays resident): drop "
    "resident_blocks (--resident-blocks) or plan the legacy loader with dynamic_vram='off' "
    "(--dynamic-vram off)")


@dataclass(frozen=True)
class LoaderPlan:
    """The loader ComfyUI runs the DiT with, and the host memory it may page-lock."""

    mode: str  # "dynamic" (ComfyUI DynamicVRAM, comfy-aimdo) | "legacy" (ModelPatcher)
    reason: str
    pinned_budget_bytes: int
    pinned_budget_source: str  # where the budget comes from, in words

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def describe(self) -> str:
        name = ("ComfyUI DynamicVRAM (comfy-aimdo: VBAR per device, one-block prefetch, "
                "ComfyUI's own pins)" if self.dynamic else
                "legacy ModelPatcher (the pack's block streamer streams)")
        return (f"{name} -- {self.reason}; pin budget {self.pinned_budget_bytes / GiB:.0f} GiB "
                f"({self.pinned_budget_source})")


@dataclass(frozen=True)
class PrefetchPlan:
    resident_blocks: int
    streamed_blocks: int
    lookahead: int
    pinned_budget_bytes: int
    source: str  # "none" | "pinned" | "pinned+pageable"
    reason: str
    streamed_refiner_blocks: int = 0  # the token refiner's, streamed once per run with them
    staged_blocks: int = 0  # host copies past the pinned budget, through the staging ring
    # who streams the non-resident blocks: "pack" (the pack's streamer, legacy loader),
    # "comfyui" (ComfyUI DynamicVRAM: its VBAR and one-block prefetch), "none"
    streamer: str = "pack"
    pinned_fraction: float = 1.0  # of the streamed blocks' host copies, the pinned share


def plan_loader(request: PlanRequest, profile: HardwareProfile) -> LoaderPlan:
    """Which loader runs the DiT (ComfyUI's rule for "auto") and the host memory that may be
    page-locked; refuses a forced residency the loader would not use."""
    if request.dynamic_vram == "auto":
        dynamic, why = profile.dynamic_vram_default()
        why = f"auto: {why}"
    else:
        dynamic = request.dynamic_vram == "on"
        why = ("switched on (ComfyUI runs with DynamicVRAM)" if dynamic else
               "switched off (--disable-dynamic-vram, --highvram, --gpu-only, --novram, ROCm "
               "below 7.14 or a ComfyUI without it)")
    if dynamic and request.resident_blocks is not None:
        raise ValueError(RESIDENT_NEEDS_LEGACY.format(n=request.resident_blocks,
                                                  why=f"on for {profile.name} ({why})"))
    if request.pinned_budget_bytes is not None:
        budget, source = request.pinned_budget_bytes, "ComfyUI's MAX_PINNED_MEMORY"
    else:
        budget = int(profile.host_ram_bytes * request.pinned_fraction)
        source = f"{request.pinned_fraction:g} of the host's {profile.host_ram_bytes / GiB:.0f} GiB"
    return LoaderPlan("dynamic" if dynamic else "legacy", why, budget, source)


def plan_prefetch(request: PlanRequest, sizes: ComponentSizes, free_for_blocks: int,
                  loader: LoaderPlan, root: int) -> PrefetchPlan:
    """Resident and streamed DiT blocks on the root GPU `root`, given the bytes left for block
    weights beside the activations of the pass that peaks, for the loader that runs."""
    block = sizes.dit_block_bytes
    refiner = geometry.REFINER_BLOCKS
    forced = request.resident_blocks is not None
    lookahead = COMFY_LOOKAHEAD if loader.dynamic else LOOKAHEAD
    if forced:
        resident = request.resident_blocks
    else:
        # offload/'s own arithmetic: all blocks, or the count that leaves room for K + 1
        # block-sized buffers (the pack's slots; under DynamicVRAM the block running and the
        # one ComfyUI stages next)
        resident = offload_sizing.resident_blocks_for_budget(
            max(free_for_blocks, 0), blocks=geometry.BLOCKS, block_bytes=block,
            lookahead=lookahead, extra_streamed=refiner)
    streamed = geometry.BLOCKS - resident
    need = offload_sizing.streamed_weight_vram_bytes(
        blocks=geometry.BLOCKS, resident=resident, block_bytes=block, lookahead=lookahead,
        extra_streamed=refiner)
    short = (f"; {resident} resident blocks as requested need {need / GiB:.1f} GiB for block "
             f"weights, {max(free_for_blocks, 0) / GiB:.1f} GiB are left beside the "
             f"activations: DOES NOT FIT" if forced and need > free_for_blocks else "")
    if loader.dynamic:
        return _dynamic_prefetch(resident, streamed, block, refiner, loader, root)
    if streamed == 0:
        reason = ("all 50 blocks resident, as requested" if forced
                  else "all 50 blocks fit on the root GPU")
        return PrefetchPlan(resident, 0, 0, 0, "none", reason + short, streamer="none")
    # what the runtime streams: the DiT blocks and the refiner's, each host copy a flat buffer
    # a little larger than its tensors (alignment); its pinned budget rule is arena_split's
    count = streamed + refiner
    flat = block + offload_sizing.ARENA_SLACK_PER_BLOCK
    host_budget = loader.pinned_budget_bytes
    reason = (f"{streamed} blocks and the token refiner's {refiner} "
              f"({count * block / GiB:.1f} GiB) stream from host memory {LOOKAHEAD} blocks "
              f"ahead (the refiner once per sampling run)")
    if count * flat <= host_budget:
        return PrefetchPlan(resident, streamed, LOOKAHEAD, count * flat, "pinned",
                            reason + ", all pinned" + short, refiner, 0)
    split = offload_sizing.arena_split([flat] * count, host_budget)
    pinned_share = (count - split.staged_blocks) / count
    reason += (f"; the {host_budget / GiB:.0f} GiB pinned budget holds "
               f"{count - split.staged_blocks} of them and the pinned staging ring "
               f"({split.staging_bytes / GiB:.1f} GiB), {split.staged_blocks} go through the "
               f"ring from pageable memory")
    return PrefetchPlan(resident, streamed, LOOKAHEAD, host_budget, "pinned+pageable",
                        reason + short, refiner, split.staged_blocks,
                        pinned_fraction=pinned_share)


def _dynamic_prefetch(resident: int, streamed: int, block: int, refiner: int,
                      loader: LoaderPlan, root: int) -> PrefetchPlan:
    """What ComfyUI's DynamicVRAM does with the DiT on the root GPU (the pack's streamer stands
    aside): its VBAR keeps what fits beside the activations, the rest is cast in from host
    memory at every step, the next block staged while one runs; ComfyUI pins host copies
    within its own budget (no staging ring)."""
    where = f"ComfyUI DynamicVRAM: its VBAR on gpu:{root}"
    if streamed == 0:
        return PrefetchPlan(resident, 0, 0, 0, "none", (
            f"all 50 blocks fit on the root GPU; {where} keeps them resident (nothing is cast "
            "in per step)"), streamer="comfyui")
    count = streamed + refiner
    budget = loader.pinned_budget_bytes
    pinned = min(count * block, budget)
    source = "pinned" if pinned == count * block else "pinned+pageable"
    reason = (f"{where} keeps about {resident} of the 50 blocks resident beside the "
              f"activations and casts the other {streamed} (and the token refiner's {refiner}, "
              f"{count * block / GiB:.1f} GiB) in from host memory at every step, the next "
              f"block staged while one runs (make_prefetch_queue, one ahead); ComfyUI pins the "
              f"host copies within its pin budget ({budget / GiB:.0f} GiB, "
              f"{loader.pinned_budget_source})")
    if source != "pinned":
        reason += (f": {(count * block - pinned) / GiB:.1f} GiB of them stay pageable "
                   "(slower copies)")
    return PrefetchPlan(resident, streamed, COMFY_LOOKAHEAD, budget, source, reason, refiner, 0,
                        streamer="comfyui", pinned_fraction=pinned / (count * block))


