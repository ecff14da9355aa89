"""The MiniMax H3 learned latent upscaler: load the community checkpoint and run it on a
ComfyUI LATENT (video resized, audio kept). No ComfyUI import here: the nodes wrap it."""

from .network import (
    LATENT_MEAN,
    LATENT_STD,
    H3LatentUpscaler,
    UpscalerShape,
    build_from_state_dict,
    strip_prefix,
)
from .run import target_latent_size, upscale_latent, upscale_video

__all__ = [
    "LATENT_MEAN",
    "LATENT_STD",
    "H3LatentUpscaler",
    "UpscalerShape",
    "build_from_state_dict",
    "strip_prefix",
    "target_latent_size",
    "upscale_latent",
    "upscale_video",
]
