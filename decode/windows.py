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

This layout is the planner's model of the windows (counts, frames, sizes). The split itself
reads only the latent stride and window length from the model (`from_model`) and takes the
window count, padding and output positions from the model's own `_decode_temporal_chunks` and
`decode_output_shape` (`decode.executor`). Names follow upstream `MiniMaxH3VideoVAE` (in
brackets where they differ), so a VAE with other window sizes is followed, not assumed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Attributes of upstream MiniMaxH3VideoVAE that describe its windows, and ours for each.
_MODEL_FIELDS = {
    "tokens_chunk_size": "stride",
    "token_overlap": "overlap",
    "vae_ratio_t": "frames_per_latent",
    "frame_pre_padding": "lead_drop",
    "frame_overlap": "crossfade",
    "token_drop": "token_drop",
}


@dataclass(frozen=True)
class WindowLayout:
    """Temporal windows of the video decoder (defaults: the released H3 VAE)."""

    stride: int = 5  # latent frames between two window starts [tokens_chunk_size]
    overlap: int = 2  # latent frames a window reads past the next window's start [token_overlap]
    frames_per_latent: int = 4  # decoded frames per latent frame [vae_ratio_t]
    lead_drop: int = 3  # decoded frames dropped before a head and before a tail [frame_pre_padding]
    crossfade: int = 5  # output frames cross-faded across a window boundary [frame_overlap]
    token_drop: int = 3  # latent frames the encoder drops at the end; > 0: windows have tails

    def __post_init__(self) -> None:
        for name in ("stride", "frames_per_latent"):
            if getattr(self, name) < 1:
                raise ValueError(f"window layout: {name}={getattr(self, name)} must be >= 1")
        for name in ("overlap", "lead_drop", "crossfade", "token_drop"):
            if getattr(self, name) < 0:
                raise ValueError(f"window layout: {name}={getattr(self, name)} must be >= 0")
        if self.head_frames < 1:
            raise ValueError(f"window layout: a head of {self.head_frames} frames is empty "
                             f"(stride {self.stride} x {self.frames_per_latent} frames minus "
                             f"{self.lead_drop} dropped)")

    @classmethod
    def from_model(cls, model: object) -> WindowLayout:
        """The layout of an upstream `MiniMaxH3VideoVAE` (ValueError naming what is missing)."""
        missing = [name for name in _MODEL_FIELDS if not isinstance(getattr(model, name, None),
                                                                     int)]
        if missing:
            raise ValueError(f"{type(model).__name__} has no integer {', '.join(missing)}: it is "
                             f"not the windowed H3 video VAE this decode splits")
        return cls(**{ours: getattr(model, theirs) for theirs, ours in _MODEL_FIELDS.items()})

    @property
    def window_latents(self) -> int:
        """Latent frames one window reads (7)."""
        return self.stride + self.overlap

    @property
    def head_frames(self) -> int:
        """Output frames a window's head covers (17)."""
        return self.stride * self.frames_per_latent - self.lead_drop

    @property
    def tail_frames(self) -> int:
        """Frames of a window's tail (5); 0 when the decoder keeps no tail (token_drop == 0)."""
        if self.token_drop == 0:
            return 0
        return max(0, self.overlap * self.frames_per_latent - self.lead_drop)

    @property
    def blend_frames(self) -> int:
        """Output frames after a window boundary that mix two windows (5)."""
        return min(self.head_frames, self.tail_frames, self.crossfade)

    def windows(self, latent_frames: int) -> tuple[int, int]:
        """(latent frames of padding, number of windows) for a latent of `latent_frames`.

        The padding repeats the last latent frame so that every window is whole; the count is
        the one the model's own loop uses (5k + 2 latent frames: no padding, k windows).
        """
        if latent_frames < 2:
            raise ValueError(f"a video latent of {latent_frames} frame(s) has no windows "
                             f"(a single frame is decoded in one call)")
        total = latent_frames + self.token_drop
        pad = (-total) % self.stride
        count = (total + pad) // self.stride - int(self.token_drop > 0)
        if count < 1:  # too short for one window: one more window of padding
            pad += self.stride
            count += 1
        return pad, count

    def written_frames(self, windows: int) -> int:
        """Frames the windows write before the output length clips them (17k + 5)."""
        return windows * self.head_frames + self.tail_frames

    def head_start(self, window: int) -> int:
        """First output frame of window `window`'s head."""
        return window * self.head_frames


def frames_to_latents(frames: int, layout: WindowLayout = WindowLayout()) -> int:
    """Output frames on the 17k+5 grid -> latent frames (5k+2) for the default layout."""
    head = layout.head_frames
    if frames < layout.tail_frames or (frames - layout.tail_frames) % head:
        raise ValueError(f"{frames} frames is not on the decoder's {head}k+{layout.tail_frames} "
                         f"grid")
    return (frames - layout.tail_frames) // head * layout.stride + layout.overlap


def assign_windows(windows: int, seconds_per_window: Sequence[float],
                   start_seconds: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous window ranges per device (device order kept) that finish soonest.

    Device d decodes a window in `seconds_per_window[d]` after `start_seconds[d]` (a helper
    first copies the decoder over). Windows are equal work, so giving each window in turn to the
    device that would finish it first minimises the last finish time; the counts are then laid
    out as contiguous ranges in device order. A device that gets no window gets (s, s).
    """
    n = len(seconds_per_window)
    if n == 0:
        raise ValueError("assign_windows needs at least one device")
    if any(not t > 0 for t in seconds_per_window):
        raise ValueError(f"seconds per window must be positive, got {list(seconds_per_window)}")
    starts = list(start_seconds) if start_seconds is not None else [0.0] * n
    if len(starts) != n:
        raise ValueError(f"{len(starts)} start times for {n} devices")
    counts = [0] * n
    heap = [(starts[d] + seconds_per_window[d], d) for d in range(n)]
    heapq.heapify(heap)
    for _ in range(windows):
        finish, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, (finish + seconds_per_window[d], d))
    ranges, at = [], 0
    for c in counts:
        ranges.append((at, at + c))
        at += c
    return ranges


def finish_seconds(ranges: Sequence[tuple[int, int]], seconds_per_window: Sequence[float],
                   start_seconds: Sequence[float] | None = None) -> float:
    """When the last device finishes its range (the decode's wall time, without the copies)."""
    starts = list(start_seconds) if start_seconds is not None else [0.0] * len(ranges)
    return max((starts[d] + (b - a) * seconds_per_window[d] if b > a else 0.0)
               for d, (a, b) in enumerate(ranges))


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
