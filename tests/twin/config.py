"""The twin's shapes and constants, and the matching constructor arguments of the upstream class.

Upstream's `MiniMaxH3Model` takes its widths as constructor keywords; `TwinConfig` holds the same
numbers under short names, and `upstream_kwargs()` maps them back so a test or a benchmark can
build the real class and the twin with one config (and load one state dict into both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from h3_multigpu.common import geometry

# Spans on the time axis of the position grid. A latent frame after the first covers 4 pixel
# frames; the whole axis is stretched by 5/3 so video and the 40 Hz audio rows share one clock.
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # repeats every 5 latent frames
TIME_STRETCH = 5.0 / 3.0
# Timesteps of condition rows: visual cond rows sit just below "clean" (and get that much noise),
# audio cond rows are clean.
VISUAL_COND_T = 0.999
AUDIO_COND_T = 1.0
# Modality tags: each timestep owns three modulation rows, in this order.
TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
# Position-grid scale of the area-normalised frame axes.
FRAME_GRID_SCALE = 32.0
SIGMA_MATH = ("float", "fp32")


@dataclass(frozen=True)
class TwinConfig:
    hidden: int = geometry.HIDDEN
    heads: int = geometry.HEADS
    head_dim: int = geometry.HEAD_DIM
    ffn: int = geometry.FFN
    blocks: int = geometry.BLOCKS
    refiner_blocks: int = geometry.REFINER_BLOCKS
    text_dim: int = 5120  # Qwen3-VL layer-50 states
    latents_dim: int = 24
    audio_latents_dim: int = 32
    # AdaLN: with `adaln_grid` set, a pruned ("curve") checkpoint: the time embedding is a
    # lerp over an fp32 table of `adaln_grid` rows of width `t_dim`, projections in fp32 without
    # SiLU. With `adaln_grid=None`, full AdaLN: a sinusoidal time embedder (fp32) of width
    # `t_dim` and SiLU + projections at the model dtype (upstream: t_dim 2688).
    t_dim: int = 8
    adaln_grid: int | None = 64
    timestep_freq_dim: int = 256
    time_embed_hidden: int | None = None  # None: same as `hidden`
    rope_freqs_per_axis: int = 16  # 3 axes x 16 x 2 = 96 rotated dims of 128
    eps: float = 1e-5
    qk_eps: float = 1e-5
    final_eps: float = 1e-5
    sigma_shift_video: float = 12.0
    sigma_shift_audio: float = 3.0
    gate_compress: bool = False  # sparse-attention gate projection (unused by the dense forward)
    # How the forward turns the sampler's sigma into the stream timesteps, as the upstream
    # release it follows does: "float" (the newest files: Python floats, so t_a = 1 - shift(s)
    # in float64) or "fp32" (ComfyUI 0.33.0: an fp32 tensor, t_a rounded in fp32; the two differ
    # in the last bit of t_a, which moves every audio row of a full-AdaLN forward).
    sigma_math: str = "float"

    def __post_init__(self) -> None:
        if self.sigma_math not in SIGMA_MATH:
            raise ValueError(f"sigma_math={self.sigma_math!r}: use one of {SIGMA_MATH} "
                             "('float' for the newest upstream files, 'fp32' for ComfyUI 0.33.0)")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def pruned_adaln(self) -> bool:
        return self.adaln_grid is not None

    @classmethod
    def full(cls, **overrides: Any) -> TwinConfig:
        """The upstream shapes: 50 blocks, 5376 hidden, 56x128 heads, FFN 14336 (pruned AdaLN)."""
        return replace(cls(), **overrides)

    @classmethod
    def full_adaln(cls, **overrides: Any) -> TwinConfig:
        """The upstream shapes with full AdaLN (time embedder, 2688-wide modulation input)."""
        return replace(cls(t_dim=2688, adaln_grid=None), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> TwinConfig:
        """A CPU-sized twin with the same structure (8 heads so head splits are interesting)."""
        base = cls(hidden=64, heads=8, head_dim=16, ffn=96, blocks=3, refiner_blocks=1,
                   text_dim=48, t_dim=8, adaln_grid=16, timestep_freq_dim=32,
                   rope_freqs_per_axis=2)
        return replace(base, **overrides)

    def upstream_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of upstream `MiniMaxH3Model(...)` for the same shapes."""
        return {
            "hidden_size": self.hidden, "num_layers": self.blocks,
            "token_refiner_num_layers": self.refiner_blocks,
            "num_attention_heads": self.heads, "attention_head_dim": self.head_dim,
            "ffn_hidden_size": self.ffn, "latents_dim": self.latents_dim,
            "audio_latents_dim": self.audio_latents_dim, "patch_size": (1, 2, 2),
            "text_dim": self.text_dim, "timestep_input_dim": self.timestep_freq_dim,
            "time_embed_hidden_size": self.time_embed_hidden or self.hidden,
            "time_embed_dim": self.t_dim, "rope_inv_freq_len": self.rope_freqs_per_axis,
            "norm_eps": self.eps, "qk_norm_eps": self.qk_eps, "final_norm_eps": self.final_eps,
            "sigma_shift_video": self.sigma_shift_video,
            "sigma_shift_audio": self.sigma_shift_audio,
            "adaln_curve_grid": self.adaln_grid, "gate_compress": self.gate_compress,
        }
