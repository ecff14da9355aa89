"""Run the learned upscaler on a ComfyUI LATENT: H3's video+audio NestedTensor or a video tensor.

The target is given in pixels and floored to the latent grid (pixels // 16), as core's H3 nodes
do: 864x480 -> 1312x736 is latent 54x30 -> 82x46 (a "1.5x" factor would give 80x44). The audio
part passes through untouched; a `noise_mask` is dropped (it no longer matches the new size);
a latent already at the target size is returned as it is.
"""

from __future__ import annotations

import torch

from ..common.geometry import SPATIAL_DOWNSCALE
from .network import LATENT_MEAN, LATENT_STD, H3LatentUpscaler

LATENT_SCALE = SPATIAL_DOWNSCALE  # pixels per latent cell (H3's VAE: 16x16 spatial)


def target_latent_size(width: int, height: int) -> tuple[int, int]:
    """(latent height, latent width) for a pixel target; ValueError below one cell."""
    if width < LATENT_SCALE or height < LATENT_SCALE:
        raise ValueError(f"target {width}x{height} is smaller than one latent cell "
                         f"({LATENT_SCALE} px); use e.g. 1312x736")
    return height // LATENT_SCALE, width // LATENT_SCALE


def upscale_video(net: H3LatentUpscaler, video_BCTHW: torch.Tensor, height: int, width: int,
                  device: torch.device | None = None) -> torch.Tensor:
    """Video latent -> (B, C, T, height, width) latent, on `video_BCTHW`'s device and dtype.

    Runs on `device` (default: the network's) in the network's dtype, normalised by the VAE's
    latent statistics; the network's scale embedding sees the mean of the two size ratios."""
    param = next(net.parameters())
    device = device or param.device
    dtype = param.dtype
    mean = torch.tensor(LATENT_MEAN, dtype=dtype, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(LATENT_STD, dtype=dtype, device=device).view(1, -1, 1, 1, 1)
    frames = int(video_BCTHW.shape[2])
    scale = (height / video_BCTHW.shape[3] + width / video_BCTHW.shape[4]) / 2.0
    with torch.inference_mode():
        x = (video_BCTHW.to(device=device, dtype=dtype) - mean) / std
        y = net(x, scale, (frames, height, width))
        y = y * std + mean
    return y.to(device=video_BCTHW.device, dtype=video_BCTHW.dtype)


def _parts(samples):
    """(video, audio or None, rebuild) for a NestedTensor (video, audio) or a plain tensor."""
    if getattr(samples, "is_nested", False):
        video, *rest = samples.tensors
        return video, rest, lambda v: type(samples)((v, *rest))
    return samples, None, lambda v: v


def upscale_latent(net: H3LatentUpscaler, latent: dict, width: int, height: int,
                   device: torch.device | None = None) -> dict:
    """A ComfyUI LATENT dict resized to `width` x `height` pixels (video only)."""
    samples = latent["samples"]
    video, _, rebuild = _parts(samples)
    if video.ndim != 5 or video.shape[1] != net.shape.latent_channels:
        raise ValueError(f"expected an H3 video latent (B, {net.shape.latent_channels}, T, H, W), "
                         f"got {tuple(video.shape)}; connect the sampler's LATENT output")
    lat_h, lat_w = target_latent_size(width, height)
    if (lat_h, lat_w) == tuple(video.shape[3:]):
        return latent
    out = {k: v for k, v in latent.items() if k != "noise_mask"}
    out["samples"] = rebuild(upscale_video(net, video, lat_h, lat_w, device))
    return out
