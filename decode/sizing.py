"""Memory and time of the video decode, from measurements (pure Python, no torch).

Measured (`shared/reference/h200x2-vae-decode.json`): the upstream decoder at its released
config (36 blocks, width 2048) with random weights, through ComfyUI's decode path, at 1312x736
on one H200 in bf16: 5.51 / 5.555 / 5.566 GiB peak for 124 / 243 / 362 frames, of which
4.85 GiB are weights; 5.86 / 11.07 / 16.77 s, i.e. 0.80 s per window of 28 tiles. The window
memory does not grow with the clip: only the latent itself (a few MB) does.

What a window holds beyond the weights is (a) the activations of one decoder call on a batch of
4 tiles of 256x256 px x 7 latent frames, the same at any canvas, and (b) the window's decoded
frames (28 frames x 3 channels in the VAE dtype), its float32 head and the cross-fade
temporaries, which scale with the canvas area. (a) is modelled from the decoder's widths; (b)
takes the rest of the measured 0.66 GiB at 1312x736 per pixel.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

GiB = 1024**3
GB = 1000**3

# --- measured at 1312x736 on one H200, bf16 -------------------------------------------------
MEASURED_WIDTH, MEASURED_HEIGHT = 1312, 736
MEASURED_WEIGHT_BYTES = 2_603_873_398 * 2  # parameters + buffers of the released config, bf16
MEASURED_PEAK_BYTES = int(5.555 * GiB)  # 243 frames (124: 5.51, 362: 5.566)
MEASURED_LATENT_FRAMES = 72  # 243 frames
MEASURED_SECONDS_PER_TILE = 16.7668 / (21 * 28)  # 362 frames: 21 windows of 28 tiles
MEASURED_MATMUL_TFLOPS = 700.0  # the H200 profile's effective GEMM rate (planner/hardware.py)

# --- the decoder (released config) ------------------------------------------------------------
DECODER_WIDTH = 2048
DECODER_FFN = 8192
DECODER_BLOCKS = 36
DECODER_PARAMS = 2_423_530_496  # decoder alone (what a helper GPU holds, + a 24x24 conv)
TILE_PX = 256
TILE_OVERLAP_PX = 64
TILE_BATCH = 4  # tiles per decoder call when the GPU has room (upstream _decode_tile_row)
SPATIAL = 16  # pixels per latent cell
WINDOW_LATENTS = 7
WINDOW_FRAMES = 28
HEAD_FRAMES = 17
BLEND_FRAMES = 5
REGISTER_TOKENS = 5  # 4 register tokens + 1 padding token per tile


def tiles_along(pixels: int, tile: int = TILE_PX, overlap_min: int = TILE_OVERLAP_PX) -> int:
    """Tiles the decoder cuts `pixels` into (as its split_tiles does: overlaps >= 64 px)."""
    if pixels <= tile:
        return 1
    n = math.ceil(pixels / tile)
    while tile * n - overlap_min * (n - 1) < pixels:
        n += 1
    return n


def tiles_per_window(width: int, height: int) -> int:
    """Spatial tiles in one window (28 at 1312x736)."""
    return tiles_along(width) * tiles_along(height)


def tile_call_bytes(element_bytes: int = 2, batch: int = TILE_BATCH) -> int:
    """Peak activations of one decoder call on `batch` tiles (independent of the canvas).

    The FFN moment dominates: the residual stream, the gated first projection [S, 2F] and its
    SwiGLU output [S, F] alive together, with S = batch x (7 x 16 x 16 + 5) tokens.
    """
    tokens = batch * (WINDOW_LATENTS * (TILE_PX // SPATIAL) ** 2 + REGISTER_TOKENS)
    per_token = 2 * DECODER_WIDTH + 2 * DECODER_FFN + DECODER_FFN
    return tokens * per_token * element_bytes


def _measured_per_pixel_bytes() -> float:
    work = (MEASURED_PEAK_BYTES - MEASURED_WEIGHT_BYTES - tile_call_bytes()
            - latent_bytes(MEASURED_WIDTH, MEASURED_HEIGHT, MEASURED_LATENT_FRAMES))
    return work / (MEASURED_WIDTH * MEASURED_HEIGHT)


def window_workspace_bytes(width: int, height: int, element_bytes: int = 2) -> int:
    """Bytes one GPU holds beyond the weights and the latent while decoding windows.

    Calibrated so that 1312x736 at 243 frames in bf16 gives the measured peak exactly (124 and
    362 frames then land within 0.3%); the per-pixel part is scaled by the dtype.
    """
    per_pixel = _measured_per_pixel_bytes() * element_bytes / 2
    return int(tile_call_bytes(element_bytes) + per_pixel * width * height)


def split_extra_bytes(width: int, height: int, element_bytes: int = 2) -> int:
    """What the split decode adds per GPU to the model's own window loop: the range's first
    head, kept raw for the cross-fade across its cut, and its last 5-frame tail (VAE dtype).
    (The cross-fades run after the windows, on the root: they add nothing to the peak.)"""
    pixels = width * height
    return pixels * 3 * (HEAD_FRAMES + BLEND_FRAMES) * element_bytes


LATENT_COPIES = 5  # the input, its cast to the VAE dtype, the de-normalised copy, temporaries


def latent_bytes(width: int, height: int, latent_frames: int, element_bytes: int = 2) -> int:
    """The video latent and its copies on the decode GPU (24 channels, /16 spatially): the only
    part of the decode's memory that grows with the clip (about 13 MB per 5 s at 1312x736)."""
    cells = 24 * latent_frames * (height // SPATIAL) * (width // SPATIAL)
    return LATENT_COPIES * cells * element_bytes


def decoder_weight_bytes(element_bytes: int = 2) -> int:
    """The decoder alone (what a helper copy holds): no encoder."""
    return (DECODER_PARAMS + 24 * 24 + 24) * element_bytes


def seconds_per_window(width: int, height: int, matmul_tflops: float) -> float:
    """Time of one window on a GPU with that effective GEMM rate (measured on an H200)."""
    scale = MEASURED_MATMUL_TFLOPS / matmul_tflops
    return tiles_per_window(width, height) * MEASURED_SECONDS_PER_TILE * scale


def boundary_piece_bytes(width: int, height: int, element_bytes: int = 2) -> int:
    """One 5-frame piece handed across a cut (VAE dtype)."""
    return width * height * 3 * BLEND_FRAMES * element_bytes


def handover_seconds(width: int, height: int, link_gbs: float, element_bytes: int = 2) -> float:
    """Moving one boundary piece between GPUs (vs a window's ~0.8 s to recompute it)."""
    return boundary_piece_bytes(width, height, element_bytes) / (link_gbs * GB)


def output_bytes(width: int, height: int, frames: int) -> int:
    """The float32 output ComfyUI allocates on the host (4.2 GB at 362 frames, 1312x736)."""
    return width * height * 3 * frames * 4


# ---- the video VAE's temporal windows (`decode.windows` tells how the split uses them)
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
