"""The video VAE's temporal windows, and how they are shared between GPUs (pure Python).

H3's video decoder never sees the whole clip: it decodes fixed windows of latent frames, one
after another, with nothing carried from one window to the next. For the released VAE:

    window i reads latent frames [5i, 5i + 7) and decodes them to 28 frames;
    its head  (decoded frames 3..19, 17 frames) goes to output frames [17i, 17i + 17);
    its tail  (decoded frames 23..27, 5 frames) is cross-faded into the first 5 frames of the
              next window's head (linear weights), or, after the last window, written as is.

So an output frame depends on one window, or on two neighbouring windows for the 5 frames after
each window boundary. Cutting the window list into contiguous ranges (one per GPU) cuts the
latent at multiples of 5 frames; each GPU runs the model's own window loop on its range, and
the only thing two GPUs must exchange is one 5-frame piece per cut (the tail of the last window
of one range) and the raw head it fades into. Handing that over (tens of MB) is always far
cheaper than decoding the neighbouring window a second time (see
`decode.sizing.handover_seconds`).

The layout (`WindowLayout`, defined in the torch-free `decode.sizing` beside the rest of the
decode's sizing) is the planner's model of the windows (counts, frames, sizes). The split itself
reads only the latent stride and window length from the model (`from_model`) and takes the
window count, padding and output positions from the model's own `_decode_temporal_chunks` and
`decode_output_shape` (`decode.executor`). Names follow upstream `MiniMaxH3VideoVAE` (in
brackets where they differ), so a VAE with other window sizes is followed, not assumed.
"""

from __future__ import annotations

import math

# the planner's model of the windows lives in sizing (torch-free, the planner reads it); the
# split and the nodes import it from here as before
from .sizing import (  # noqa: F401
    WindowLayout,
    assign_windows,
    finish_seconds,
    frames_to_latents,
)


def parse_weights(text: str, devices: int) -> tuple[float, ...] | None:
    """'auto' -> None (equal, or the planner's throughputs); '1:0.7' -> relative speeds."""
    text = text.strip().lower()
    if text in ("", "auto"):
        return None
    try:
        values = tuple(float(p) for p in text.replace(",", ":").split(":"))
    except ValueError:
        raise ValueError(f"decode shares {text!r} are not numbers; write relative speeds like "
                         f"'1:0.7' (root first) or 'auto'") from None
    if len(values) != devices:
        raise ValueError(f"decode shares {text!r} give {len(values)} values for {devices} "
                         f"devices (root first, then each helper)")
    if any(not 0 < v < math.inf for v in values):
        raise ValueError(f"decode shares {text!r} must all be positive and finite; write "
                         f"relative speeds like '1:0.7', and leave a GPU out of the device list "
                         f"instead of giving it 0")
    return values
