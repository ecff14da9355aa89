"""Workspace estimates for the helper GPU's phases (pure arithmetic, no torch).

The Dual-Sage helper workspace mirrors `dual_sage/`: the helper's share of q, k, v and its
output travel in head chunks through a small ring of buffers, so the helper holds
`ring x chunk_heads` heads' worth of q, k, v and output at a time. The latent-upscaler and VAE
numbers are estimates (we cannot run the real weights here) and are labelled as such in reports.
"""

from __future__ import annotations

from .. import geometry

HELPER_CHUNK_HEADS = 7  # heads per transfer chunk
HELPER_RING = 2  # chunk buffers in flight on the helper
UPSCALER_CHANNELS = 512
UPSCALER_LIVE_TENSORS = 3
UPSCALER_SLAB_FRAMES = 8  # latent frames per temporal slab of the 3D convs


def dual_sage_helper_workspace(tokens: int, helper_heads: int, head_dim: int = geometry.HEAD_DIM,
                               element_bytes: int = 2, chunk_heads: int = HELPER_CHUNK_HEADS,
                               ring: int = HELPER_RING) -> int:
    """Bytes a helper GPU holds for its attention share: q, k, v and out per buffered chunk."""
    heads_held = min(helper_heads, chunk_heads * ring)
    return 4 * heads_held * tokens * head_dim * element_bytes


def upscale_workspace(pass1: geometry.PassGeometry, pass2: geometry.PassGeometry) -> int:
    """The learned upscaler's conv activations at the output size, in temporal slabs."""
    _, _, t, h, w = pass2.latent
    slab = min(t, UPSCALER_SLAB_FRAMES)
    latents = 2 * (pass1.latent[2] * pass1.latent[3] * pass1.latent[4]
                   + t * h * w) * 24 * 4  # input + output latents, fp32
    return UPSCALER_CHANNELS * slab * h * w * 2 * UPSCALER_LIVE_TENSORS + latents


def vae_decode_workspace(pass2: geometry.PassGeometry, slab_frames: int,
                         bytes_per_pixel: int) -> int:
    """Video VAE decode in temporal slabs (decoded frames leave the GPU slab by slab)."""
    pixels = pass2.width * pass2.height
    return pixels * min(slab_frames, pass2.frames) * bytes_per_pixel
