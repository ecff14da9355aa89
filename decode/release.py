"""What the split decode needs of the H3 video VAE class, detected on the model in hand.

The split never re-states the VAE's window or tile math. Each GPU runs the VAE's own
`decode_temporal` on a contiguous latent range cut at window starts, so the windows, their
padding, the spatial tiles (and, where the release has them, its tile batches), the cross-fades
inside a range, the float32 finalisation and the writes are the release's own code. The split adds
only the cross-fade across each cut, with the model's own `blend` and `_finalize_pixels` on the
two pieces the model itself produced (seen by wrapping those methods on a view of the model).

Releases read (`comfy/ldm/minimax/vae.py`, `MiniMaxH3VideoVAE`):
- ComfyUI 0.33.0: `decode_temporal` -> `_adaptive_decode` -> `tiled_decode`, which calls
  `_decode_pixels` on one spatial tile at a time.
- the newest files: the same loop; `tiled_decode` decodes each row of tiles through
  `_decode_tile_row`, a few tiles per `_decode_pixels` call, the count chosen from the free memory
  of the device (so GPUs with different free memory may batch differently: see the report).
Both have `_decode_temporal_chunks` (padding, window count) and `decode_output_shape`.
"""

from __future__ import annotations

from torch import nn

# the window loop's names (ComfyUI internals, listed per release): the seam spells them
from ..comfy_seam.vae import INNER, WINDOW_ATTRS, WINDOW_LOOP

SHAPES = {
    "0.33.0": "the ComfyUI 0.33.0 VAE: tiled_decode decodes one tile per decoder call",
    "newest": "the newest VAE: tiled_decode batches tiles per decoder call (_decode_tile_row)",
}


def release_shape(model: nn.Module) -> str:
    """Which of the known window codes this VAE runs (for the status line)."""
    if callable(getattr(model, "_decode_tile_row", None)):
        return SHAPES["newest"]
    return SHAPES["0.33.0"]


def replaced_method(model: nn.Module, name: str) -> bool:
    """True when `name` is set on the instance by something other than ComfyUI's restore.

    ComfyUI restores an object patch by setting the class method, bound to the model, back on
    the instance: that one is the model's own method; anything else is another patch."""
    own = vars(model).get(name)
    if own is None:
        return False
    restored = (getattr(own, "__self__", None) is model
                and getattr(own, "__func__", None) is getattr(type(model), name, None))
    return not restored


def check_splittable(model: nn.Module) -> str | None:
    """None when each GPU can run this VAE's own window loop on its latent range, else why not
    (the missing method or attribute and the release shape that has it)."""
    for name in WINDOW_LOOP:
        if not callable(getattr(type(model), name, None)):
            return (f"the VAE has no {name} method ({type(model).__name__}; the H3 video VAE "
                    f"of ComfyUI 0.33.0 and of the newest files has {', '.join(WINDOW_LOOP)})")
    for name in WINDOW_ATTRS:
        if not isinstance(getattr(model, name, None), int):
            return (f"the VAE has no integer {name} ({type(model).__name__} is not the windowed "
                    f"H3 video VAE this decode splits)")
    for name in WINDOW_LOOP[1:] + INNER:  # decode_temporal itself is where our patch sits
        if replaced_method(model, name):
            return f"the VAE's {name} is replaced on this model by another patch"
    return None
