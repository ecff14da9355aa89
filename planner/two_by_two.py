"""CFG Split times sequence parallel (2x2) as a mode of a pass ("cfg_sequence"), four GPUs up.

Above CFG 1, ComfyUI's MultiGPU CFG Split (max_gpus 2) runs cond on the root and uncond on its
copy on core's first other GPU (the planner's first helper); the pack's sequence mode then runs
one group a cond (`sequence.cfg_groups`): the root with the second helper, the copy with the
third. Each pair splits its cond's rows in two and exchanges heads inside the pair; the pairs
exchange nothing. The step is the slower pair's one call, timed with the same rates and link
as the sequence mode; the memory is every GPU holding a whole DiT (ComfyUI's copy or clone,
with its LoRA) beside one pair-share of one call's activations.

Planned unchunked and unstreamed on the helpers, as CFG Split itself (`cfg_split`): refused
where chunking is forced on, the root would need the pack's streamer, a pair's row share falls
below the exact range, or a GPU cannot hold its copy. A fifth GPU and more sit idle: the pack's
sequence helpers are then the first three (`sequence_helpers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..chunking import sizing as block_sizing
from ..common import geometry
from ..sequence import sizing as sequence_sizing
from . import cfg_split, timing
from .hardware import GiB
from .memory import ChunkSettings
from .parallel import EXACT_MIN_ROWS, TWO_BY_TWO, TWO_BY_TWO_GPUS

if TYPE_CHECKING:
    from .modes import DiTContext, PassMemory
    from .residency import PrefetchPlan

MODE = TWO_BY_TWO
GPUS = TWO_BY_TWO_GPUS
WORDS = "CFG split x sequence parallel (2x2)"
NEEDS_FOUR = f"CFG split x sequence parallel needs {GPUS} GPUs, one pair a cond"
HOW = ("the H3 Multi-GPU node applies the pack's sequence mode (helpers: the three GPUs "
       "beside the root) and then ComfyUI's MultiGPU CFG Split (max_gpus 2): one sequence pair "
       "a cond")


def pairs(ctx: DiTContext) -> tuple[tuple[int, int], tuple[int, int]]:
    """(root, second helper) and (CFG Split's GPU = first helper, third helper)."""
    return (ctx.root, ctx.helpers[1]), (ctx.helpers[0], ctx.helpers[2])


def sequence_helpers(helpers: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The sequence mode's helpers in 2x2: CFG Split's GPU first, then one for each pair."""
    return tuple(helpers[:GPUS - 1])


def _pair_weights(ctx: DiTContext, pair: tuple[int, int]) -> tuple[float, float]:
    weights = tuple(ctx.rates[i].gemm_tflops for i in pair)
    return weights if len(set(weights)) > 1 else (1.0, 1.0)  # type: ignore[return-value]


def unavailable(ctx: DiTContext, calls: int) -> str | None:
    """Why the 2x2 is no candidate (CFG 1: one model call a step; fewer than four GPUs), or
    None."""
    if calls != 2:
        return cfg_split.AT_CFG_1
    return NEEDS_FOUR if len(ctx.helpers) < GPUS - 1 else None


def memory(ctx: DiTContext, tokens: int) -> PassMemory:
    """Every GPU: a whole DiT and one pair-share of one call's activations."""
    from .modes import PassMemory

    adapters = block_sizing.Adapters.turbo_lora(ctx.request.lora_rank)
    root_peak, helper_peak, refusal = 0, 0, None
    for pair in pairs(ctx):
        weights = _pair_weights(ctx, pair)
        heads = tuple(sequence_sizing.split_counts(geometry.HEADS, weights))
        peaks = sequence_sizing.sequence_memory(tokens, heads, row_weights=weights,
                                                adapters=adapters, kernels=ctx.kernels,
                                                ffn_chunk=0)
        root_peak = max(root_peak, peaks[0].peak)
        helper_peak = max(helper_peak, *(p.peak for p in peaks))
        shares = sequence_sizing.split_counts(tokens, weights)
        if min(shares) < EXACT_MIN_ROWS and refusal is None:
            refusal = (f"{tokens:,} tokens give a GPU of a pair {min(shares):,} rows, below "
                       f"the exact range ({EXACT_MIN_ROWS:,})")
    whole, _ = cfg_split.clone_bytes(ctx)
    helpers = sequence_helpers(ctx.helpers)
    free = min(ctx.placement.helper_free_bytes,
               *(ctx.placement.usable_bytes[i] for i in helpers[1:]))
    if ctx.request.chunking == "on":
        refusal = refusal or cfg_split.NEEDS_CHUNKING
    if whole + helper_peak + cfg_split.SPARE_BYTES > free:
        refusal = refusal or (f"a helper cannot hold a whole DiT ({whole / GiB:.1f} GiB) beside "
                              f"{helper_peak / GiB:.1f} GiB of a pair's activations")
    return PassMemory(mode=MODE, chunks=ChunkSettings(), root_activation_bytes=root_peak,
                      phase="sequence block", helper_activation_bytes=helper_peak,
                      helper_dit_bytes=whole, helper_weights="replica", refusal=refusal)


def step(ctx: DiTContext, *, tokens: int, prefetch: PrefetchPlan) -> timing.StepTime:
    """The slower pair's sequence block, one call a step; the root's unhidden copies."""
    link = ctx.profile.link
    block = 0.0
    for pair in pairs(ctx):
        weights = _pair_weights(ctx, pair)
        heads = tuple(sequence_sizing.split_counts(geometry.HEADS, weights))
        block = max(block, timing.sequence_block_s(
            tokens, [ctx.rates[i] for i in pair], heads, link, row_weights=weights,
            helper_streamed_block_bytes=0))
    copy = timing.block_copy_s(ctx.sizes.dit_block_bytes, link,
                               pinned_fraction=prefetch.pinned_fraction)
    stream = timing.streaming_s(comfy_streams=prefetch.streamer == "comfyui",
                                streamed=prefetch.streamed_blocks, block_s=block, copy_s=copy)
    return timing.StepTime(mode=MODE, block_s=block, streaming_s=stream, calls=1)
