"""MiniMax H3 geometry: canvases, the 17k+5 frame grid, latent shapes, token counts, bytes.

Pure Python, no torch: the planner, the CLI, the workflow tests and the submission client all
validate sizes with these functions before any weight moves.

Facts encoded here (see H3_FACTS.md section 3):
- pixels -> latent is /16 in each spatial dim, and the DiT's 2x2 patch needs an even latent,
  so a canvas side must be a multiple of 32;
- frames live on the grid 17k+5 (24 fps); latent frames T = 2 if F <= 5 else (F-5)//17*5 + 2;
- audio runs at 40 latent steps per second, stereo packed as 2 rows per step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

FPS = 24
SPATIAL_DOWNSCALE = 16  # pixels per latent cell
PATCH = 2  # the DiT's 2x2 spatial patch
CANVAS_MULTIPLE = SPATIAL_DOWNSCALE * PATCH  # 32
AUDIO_LATENT_HZ = 40
AUDIO_ROWS_PER_STEP = 2  # left channel rows then right channel rows
MIN_FRAMES = 5
FRAME_STEP = 17
MAX_PIXEL_AREA = 768 * 1344  # the native canvas; larger canvases leave the training range
# Beyond these the job is refused, not planned: upstream's H3 nodes take sides up to 16384 px
# and lengths up to 3600 frames; a canvas 16x the native area is far past anything trained.
MAX_CANVAS_SIDE = 16384
ABSURD_PIXEL_AREA = 16 * MAX_PIXEL_AREA
TRAINED_FRAMES = (124, 362)  # 5 s .. 15 s
# the last 17k+5 count within upstream EmptyMiniMaxH3LatentAV's `length` maximum of 3600
MAX_FRAMES = 3592
MAX_SECONDS = MAX_FRAMES / FPS  # 149.67 s

# The DiT's widths (full upstream config); bytes per token of the activations that matter for
# memory, in the compute dtype (bf16 = 2 bytes per element).
HIDDEN = 5376
HEADS = 56
HEAD_DIM = 128
INNER = HEADS * HEAD_DIM  # 7168
FFN = 14336
BLOCKS = 50
REFINER_BLOCKS = 2


def _nearest_multiple(value: int, multiple: int) -> int:
    low = max(multiple, (value // multiple) * multiple)
    high = low + multiple
    return low if value - low < high - value else high  # ties round up: 1296 -> 1312


def as_int(value: object, what: str) -> int:
    """`value` as a Python int when it is an integer of any kind (numpy's too), else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


def validate_canvas(width: int, height: int) -> tuple[int, int]:
    """Return (width, height) as ints when H3 accepts them, else raise ValueError.

    The message names the bad value and the nearest valid canvas, e.g. 1296x720 -> 1312x736.
    Canvases over the native area are accepted (see `canvas_warning`) up to 16x that area.
    """
    for name, value in (("width", width), ("height", height)):
        value = as_int(value, f"canvas {name} (pixels)")
        if value <= 0:
            raise ValueError(f"canvas {name} must be positive, got {value}")
        if value > MAX_CANVAS_SIDE:
            raise ValueError(f"canvas {name} {value} is larger than H3's nodes take "
                             f"({MAX_CANVAS_SIDE} px); the native canvas is 1344x768")
    width, height = int(width), int(height)
    if width * height > ABSURD_PIXEL_AREA:
        raise ValueError(f"canvas {width}x{height} is {width * height / MAX_PIXEL_AREA:.1f}x "
                         f"H3's native area (1344x768), far past anything it was trained on; "
                         f"use at most {ABSURD_PIXEL_AREA // MAX_PIXEL_AREA}x that area "
                         f"(e.g. 5376x3072), or 1312x736 upscaled afterwards")
    if width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
        fixed_w = _nearest_multiple(width, CANVAS_MULTIPLE)
        fixed_h = _nearest_multiple(height, CANVAS_MULTIPLE)
        raise ValueError(
            f"canvas {width}x{height} is not valid for H3: width and height must be multiples of "
            f"{CANVAS_MULTIPLE} (latent = pixels/{SPATIAL_DOWNSCALE} and the 2x2 patch needs an "
            f"even latent); use {fixed_w}x{fixed_h}"
        )
    return width, height


def validate_two_pass(pass1_width: int, pass1_height: int, pass2_width: int,
                      pass2_height: int) -> None:
    """Both canvases valid, and PASS2 (which refines the upscaled PASS1) no smaller in a side."""
    validate_canvas(pass1_width, pass1_height)
    validate_canvas(pass2_width, pass2_height)
    if pass2_width < pass1_width or pass2_height < pass1_height:
        raise ValueError(
            f"PASS2 {pass2_width}x{pass2_height} is smaller than PASS1 "
            f"{pass1_width}x{pass1_height}; PASS2 refines the upscaled PASS1 result, so give "
            f"it the larger canvas (e.g. 864x480 -> 1312x736)")


def canvas_warning(width: int, height: int, label: str = "canvas") -> str | None:
    """A sentence when the canvas is over H3's native area (accepted, but untrained)."""
    area = width * height
    if area <= MAX_PIXEL_AREA:
        return None
    return (f"{label} {width}x{height} is {area / MAX_PIXEL_AREA:.2f}x H3's native area "
            f"(1344x768): outside the training range, expect lower quality")


def frames_warning(frames: int) -> str | None:
    """A sentence when the clip is outside H3's trained 124..362 frames (accepted)."""
    low, high = TRAINED_FRAMES
    if low <= frames <= high:
        return None
    return (f"{frames} frames ({frames / FPS:.1f} s) is outside H3's trained range {low}..{high} "
            f"frames (5-15 s): expect lower quality")


def snap_frames(seconds: float) -> int:
    """Seconds of video at 24 fps -> frame count on H3's 17k+5 grid (rounded up).

    5 -> 124, 10 -> 243, 12 -> 294, 15 -> 362.
    """
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        # an int past a float's range (a 400-digit JSON number) would make isfinite() raise
        # OverflowError; clamped, it is refused below as too long like any other
        seconds = float(max(-10**300, min(seconds, 10**300)))
    if not isinstance(seconds, numbers.Real) or isinstance(seconds, bool) \
            or not math.isfinite(seconds):
        raise ValueError(f"duration must be a finite number of seconds, got {seconds!r}; use "
                         f"e.g. 5 (124 frames)")
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {seconds} s; use e.g. 5 (124 frames)")
    if seconds > MAX_SECONDS:
        raise ValueError(f"duration {seconds:g} s is longer than H3's nodes take "
                         f"({MAX_SECONDS:.1f} s = {MAX_FRAMES} frames); it was trained on 5-15 s")
    n = max(MIN_FRAMES, round(seconds * FPS))
    return n + (MIN_FRAMES - n % FRAME_STEP) % FRAME_STEP


def validate_frames(frames: int) -> int:
    """Return frames unchanged when on the 17k+5 grid, else raise naming the nearest valid count."""
    frames = as_int(frames, "frame count")
    if frames < MIN_FRAMES:
        raise ValueError(f"frame count {frames} is too small; the smallest H3 clip is 5 frames")
    if frames > MAX_FRAMES:
        raise ValueError(f"frame count {frames} is more than H3's nodes take (at most "
                         f"{MAX_FRAMES}); it was trained on 124..362 frames (5-15 s)")
    if (frames - MIN_FRAMES) % FRAME_STEP:
        below = frames - (frames - MIN_FRAMES) % FRAME_STEP
        above = below + FRAME_STEP
        raise ValueError(
            f"frame count {frames} is not on H3's 17k+5 grid; use {below} or {above} "
            f"(5 s = 124, 10 s = 243, 12 s = 294, 15 s = 362)"
        )
    return frames


def latent_frames(frames: int) -> int:
    """Pixel frames (17k+5) -> latent frames T."""
    validate_frames(frames)
    return 2 if frames <= MIN_FRAMES else ((frames - MIN_FRAMES) // FRAME_STEP) * 5 + 2


def audio_latent_steps(frames: int) -> int:
    """Pixel frames -> audio latent length (40 Hz)."""
    frames = as_int(frames, "frame count")
    if not 0 <= frames <= MAX_FRAMES:
        raise ValueError(f"frame count {frames} must be between 0 and {MAX_FRAMES}")
    return round(frames / FPS * AUDIO_LATENT_HZ)


def latent_shape(width: int, height: int, frames: int) -> tuple[int, int, int, int, int]:
    """Video latent [1, 24, T, H/16, W/16]."""
    validate_canvas(width, height)
    return (
        1,
        24,
        latent_frames(frames),
        height // SPATIAL_DOWNSCALE,
        width // SPATIAL_DOWNSCALE,
    )


def audio_latent_shape(frames: int) -> tuple[int, int, int, int]:
    """Audio latent [1, 32, 2, T_a]."""
    validate_frames(frames)
    return (1, 32, AUDIO_ROWS_PER_STEP, audio_latent_steps(frames))


def tokens_per_latent_frame(width: int, height: int) -> int:
    validate_canvas(width, height)
    return (width // CANVAS_MULTIPLE) * (height // CANVAS_MULTIPLE)


def video_tokens(width: int, height: int, frames: int) -> int:
    return latent_frames(frames) * tokens_per_latent_frame(width, height)


def audio_tokens(frames: int) -> int:
    return audio_latent_steps(validate_frames(frames)) * AUDIO_ROWS_PER_STEP


def video_audio_tokens(width: int, height: int, frames: int) -> int:
    """Video + audio tokens of the packed sequence (text excluded).

    1312x736 at 362 frames -> 102,107.
    """
    return video_tokens(width, height, frames) + audio_tokens(frames)


# a bound for prompt tokens (real prompts take ~100-1000) and the longest sequence a job within
# the bounds above can make, text included
MAX_TEXT_TOKENS = 32768
MAX_SEQUENCE_TOKENS = video_audio_tokens(5376, 3072, MAX_FRAMES) + MAX_TEXT_TOKENS


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes per token of the per-block tensors that set the activation peak."""

    hidden: int  # the residual stream / normed input [S, 5376]
    qkv: int  # qkv_proj output [S, 21504]
    attention_out: int  # attention output [S, 7168]
    fc1: int  # mlp.fc1 output [S, 28672]
    swiglu: int  # SwiGLU product [S, 14336]


def activation_bytes_per_token(
    element_bytes: int = 2,
    hidden: int = HIDDEN,
    inner: int = INNER,
    ffn: int = FFN,
) -> ActivationBytes:
    """Bytes per token of each per-block activation; bf16 defaults reproduce H3_FACTS."""
    return ActivationBytes(
        hidden=hidden * element_bytes,
        qkv=3 * inner * element_bytes,
        attention_out=inner * element_bytes,
        fc1=2 * ffn * element_bytes,
        swiglu=ffn * element_bytes,
    )


def attention_flops(seq_len: int, heads: int = HEADS, head_dim: int = HEAD_DIM) -> int:
    """FLOPs of one non-causal attention call (QK^T and PV): 4 * S^2 * d * heads."""
    return 4 * seq_len * seq_len * head_dim * heads


def linear_flops_per_token(hidden: int = HIDDEN, inner: int = INNER, ffn: int = FFN) -> int:
    """FLOPs per token of one block's four linears (2 per multiply-add)."""
    return 2 * (hidden * 3 * inner + inner * hidden + hidden * 2 * ffn + ffn * hidden)


@dataclass(frozen=True)
class PassGeometry:
    """One sampling pass: canvas, frames and everything derived from them."""

    width: int
    height: int
    frames: int

    def __post_init__(self) -> None:
        validate_canvas(self.width, self.height)
        validate_frames(self.frames)

    @classmethod
    def from_seconds(cls, width: int, height: int, seconds: float) -> PassGeometry:
        return cls(width, height, snap_frames(seconds))

    @property
    def seconds(self) -> float:
        return self.frames / FPS

    @property
    def tokens(self) -> int:
        return video_audio_tokens(self.width, self.height, self.frames)

    @property
    def latent(self) -> tuple[int, int, int, int, int]:
        return latent_shape(self.width, self.height, self.frames)

    @property
    def audio_latent(self) -> tuple[int, int, int, int]:
        return audio_latent_shape(self.frames)

    @property
    def over_native_area(self) -> bool:
        return self.width * self.height > MAX_PIXEL_AREA

    def describe(self) -> str:
        return f"{self.width}x{self.height}, {self.frames} frames ({self.seconds:.2f} s)"
