"""Workspace estimates for the helper GPU's phases (pure arithmetic, no torch).

The Dual-Sage helper workspace comes from `dual_sage/sizing.py` (its ring of head chunks).
The latent-upscaler
numbers are estimates (labelled as such in reports); the video decode's are measured and live in
`decode/sizing.py` (used by `planner/decode.py`).
"""

from __future__ import annotations

from ..common import geometry
from ..dual_sage import sizing as dual_sage_sizing

UPSCALER_CHANNELS = 512
UPSCALER_LIVE_TENSORS = 3
UPSCALER_SLAB_FRAMES = 8  # latent frames per temporal slab of the 3D convs


def dual_sage_helper_workspace(tokens: int, helper_heads: int, host_relay: bool) -> int:
    """Bytes a helper GPU holds for its attention share (Dual-Sage's ring of head chunks, whose
    size follows the transport)."""
    return dual_sage_sizing.helper_workspace_bytes(
        tokens, helper_heads, geometry.HEAD_DIM,
        chunk_heads=dual_sage_sizing.chunk_heads_for(host_relay))


def upscale_workspace(pass1: geometry.PassGeometry, pass2: geometry.PassGeometry) -> int:
    """The learned upscaler's conv activations at the output size, in temporal slabs."""
    _, _, t, h, w = pass2.latent
    slab = min(t, UPSCALER_SLAB_FRAMES)
    latents = 2 * (pass1.latent[2] * pass1.latent[3] * pass1.latent[4]
                   + t * h * w) * 24 * 4  # input + output latents, fp32
    return UPSCALER_CHANNELS * slab * h * w * 2 * UPSCALER_LIVE_TENSORS + latents
