"""The H3 video VAE's window loop: the method and attribute names the split decode relies on.

ComfyUI internals (`comfy/ldm/minimax/vae.py`, `MiniMaxH3VideoVAE`; each listed in
`internals.INTERNALS`, which a `comfyui` test resolves on ComfyUI 0.33.0 and the newest-files
bed): the split calls or wraps `WINDOW_LOOP` on a view of the model (both releases), reads
`WINDOW_ATTRS` (both), and requires that none of `INNER` is replaced on the instance
(`tiled_decode`, `split_tiles`: both; `_decode_tile_row`: the newest files only).
"""

from __future__ import annotations

from typing import Any

from .names import VAE_DECODE_LOOP

# called by the split itself, or wrapped on a view of the model: the split needs every one
WINDOW_LOOP = (VAE_DECODE_LOOP, "decode_output_shape", "_decode_temporal_chunks",
               "_adaptive_decode", "_finalize_pixels", "blend", "_decode_pixels")
# read by the split: the latent frames between window starts and past them, the cross-fade
WINDOW_ATTRS = ("tokens_chunk_size", "token_overlap", "frame_overlap")
# run by the VAE's own code inside a window; optional (a release may lack some), but one
# replaced on the instance would not follow a view or a copy of the model
INNER = ("tiled_decode", "_decode_tile_row", "split_tiles")


def drop_loop_patch(view: Any) -> None:
    """Take the object patch on the window loop (the pack's own, when the view was copied from
    the patched root) off a view of the model, so the view runs the class's own loop."""
    view.__dict__.pop(VAE_DECODE_LOOP, None)
