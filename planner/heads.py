"""Heads mode (Dual-Sage) as the planner sees it: whether it can run here, its split, the
length it pays from, and per pass whether that pass reaches it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common import geometry
from . import timing
from .hardware import HardwareProfile
from .parallel import MARGIN
from .placement import Placement
from .request import PlanRequest

if TYPE_CHECKING:
    from .modes import DiTContext

@dataclass(frozen=True, kw_only=True)
class DualSageSetup:
    """Dual-Sage as it would run here, before any pass picks it."""

    possible: bool
    split: tuple[int, ...]  # heads per device, root first
    min_tokens: int
    transport: str  # "peer" | "host" | "none"
    reason: str  # why not, or the link it would use


def heads_available(ctx: DiTContext, tokens: int) -> str | None:
    """None when heads mode can run this pass, else why not."""
    if not ctx.dual.possible:
        return f"Dual-Sage is off ({ctx.dual.reason})"
    if tokens < ctx.dual.min_tokens:
        return f"{tokens:,} tokens are below Dual-Sage's min_tokens ({ctx.dual.min_tokens:,})"
    return None


def plan_dual_sage(*, request: PlanRequest, profile: HardwareProfile, placement: Placement,
                   rates: tuple[timing.GPURates, ...], tokens: int) -> DualSageSetup:
    """Whether heads mode is possible here: the split by attention throughput, the length it
    pays from, and (auto) whether it speeds up attention at PASS2's length at all."""
    none = (geometry.HEADS,)
    if not placement.helpers:
        return DualSageSetup(possible=False, split=none, min_tokens=0, transport="none",
                             reason="one GPU: nothing to shard onto")
    if request.dual_sage == "off":
        return DualSageSetup(possible=False, split=none, min_tokens=0, transport="none",
                             reason="switched off")
    root = rates[placement.root]
    helpers = [rates[h] for h in placement.helpers]
    split = timing.split_heads_by_throughput([root.attention_tflops]
                                             + [h.attention_tflops for h in helpers])
    link = profile.link
    transport = "peer" if link.peer_access else "host"
    single = timing.attention_s(tokens, root)
    gain = single / timing.dual_sage_attention_s(tokens, root, helpers, link, split)
    min_tokens = timing.choose_min_tokens(root, helpers, link, split)
    words = (f"attention {gain:.2f}x at {tokens:,} tokens over the {transport} link at "
             f"{link.helper_gbs:.0f} GB/s; calls below {min_tokens:,} tokens stay on the root")
    if request.dual_sage == "on" or gain >= MARGIN:
        return DualSageSetup(possible=True, split=split, min_tokens=min_tokens,
                             transport=transport, reason=words)
    return DualSageSetup(possible=False, split=none, min_tokens=min_tokens, transport=transport,
                         reason=f"would run attention at only {gain:.2f}x over the "
                                f"{transport} link at {link.helper_gbs:.0f} GB/s")
