"""The smallest change that makes a job fit: a shorter clip, a smaller PASS2 canvas."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..common import geometry

if TYPE_CHECKING:
    from .plan import Plan

# PASS2 canvases tried when shrinking, largest first (all multiples of 32)
SMALLER_CANVASES = [(1312, 736), (1280, 704), (1152, 640), (1024, 576), (960, 544), (864, 480)]


def suggest_fixes(plan: Plan) -> list[str]:
    from .plan import plan_job

    request = plan.request
    out: list[str] = []
    frames = request.frame_count
    # 1. shorter clip, same canvas: the longest that fits, by bisection over the 17k+5 grid
    # (memory only grows with the frame count), so any length costs a dozen plans at most
    longest = _longest_fitting_frames(request, frames)
    if longest is not None:
        out.append(f"a shorter clip fits: {longest} frames ({longest / geometry.FPS:.1f} s) at "
                   f"{request.width}x{request.height}")
    # 2. smaller PASS2 canvas, same duration (never below PASS1: PASS2 refines its upscale)
    for w, h in SMALLER_CANVASES:
        if w * h >= request.width * request.height:
            continue
        if w < request.pass1_width or h < request.pass1_height:
            continue
        candidate = plan_job(replace(request, width=w, height=h), suggest=False)
        if candidate.fits:
            out.append(f"a smaller PASS2 canvas fits: {w}x{h} at {frames} frames")
            break
    # 3. more streaming / chunking if the request pinned them
    if request.resident_blocks is not None and request.resident_blocks > 0:
        out.append("let the planner choose resident blocks (resident_blocks=None) to stream more")
    if request.chunking == "off":
        out.append("allow FFN/QKV chunking (chunking='auto')")
    if not out:
        out.append("no smaller job on this hardware fits: use a GPU with more memory")
    return out


def _longest_fitting_frames(request, frames: int) -> int | None:
    """The longest clip of at least 124 frames and shorter than `frames` that fits, or None."""
    from .plan import plan_job

    def fits(k: int) -> bool:
        f = geometry.MIN_FRAMES + k * geometry.FRAME_STEP
        return plan_job(replace(request, frames=f, seconds=None), suggest=False).fits

    low = (geometry.TRAINED_FRAMES[0] - geometry.MIN_FRAMES) // geometry.FRAME_STEP  # 124
    high = (frames - geometry.MIN_FRAMES) // geometry.FRAME_STEP - 1
    if high < low or not fits(low):
        return None
    while low < high:  # invariant: `low` fits
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return geometry.MIN_FRAMES + low * geometry.FRAME_STEP
