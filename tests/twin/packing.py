"""Latents <-> packed rows: 1x2x2 video patches, channel-major stereo audio, condition rows.

Video `[1, c, T, H, W]` -> rows (t, h/2, w/2) of `c*4` values (c, dy, dx); audio
`[1, c, 2, T]` -> 2T rows of c values, left channel first. Condition latents (keyframes,
references) get the same packing plus a little noise: rows = aug * rows + (1 - aug) * noise,
with noise drawn on the CPU from `seed` (video) or `seed + 1` (audio), the same draw for every
condition latent, and no noise at aug >= 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import AUDIO_COND_T, VISUAL_COND_T


def pad_to_even(video_BCTHW: torch.Tensor) -> torch.Tensor:
    """Circular padding of odd H / W up to the 2x2 patch (ComfyUI's pad_to_patch_size)."""
    pad_h, pad_w = video_BCTHW.shape[-2] % 2, video_BCTHW.shape[-1] % 2
    if not (pad_h or pad_w):
        return video_BCTHW
    return F.pad(video_BCTHW, (0, pad_w, 0, pad_h, 0, 0), mode="circular")


def video_to_rows(video_BCTHW: torch.Tensor) -> torch.Tensor:
    b, c, t, h, w = video_BCTHW.shape
    cells = video_BCTHW.reshape(b, c, t, h // 2, 2, w // 2, 2)
    return cells.permute(0, 2, 3, 5, 1, 4, 6).reshape(b * t * (h // 2) * (w // 2), c * 4)


def rows_to_video(rows: torch.Tensor, t: int, h: int, w: int, c: int) -> torch.Tensor:
    """[t*h*w, c*4] patch rows -> [1, c, t, 2h, 2w]."""
    cells = rows.reshape(1, t, h, w, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return cells.reshape(1, c, t, h * 2, w * 2)


def audio_to_rows(audio_BCKT: torch.Tensor) -> torch.Tensor:
    return audio_BCKT[0].permute(1, 2, 0).reshape(-1, audio_BCKT.shape[1])


def rows_to_audio(rows: torch.Tensor) -> torch.Tensor:
    steps = rows.shape[0] // 2
    return rows.reshape(2, steps, rows.shape[-1]).permute(2, 0, 1).unsqueeze(0)


def _augmented(rows: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    if aug >= 1.0:
        return rows
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed),
                        dtype=torch.float32)
    return aug * rows + (1.0 - aug) * noise.to(rows.device)


def condition_rows(payload: dict, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(visual condition rows [N, 4c] fp32, audio condition rows [M, c] fp32), None if absent."""
    seed = int(payload.get("seed", 0))
    visual_aug = payload.get("visual_cond_noise_aug", VISUAL_COND_T)
    audio_aug = payload.get("audio_cond_noise_aug", AUDIO_COND_T)
    visual = [_augmented(video_to_rows(z.to(torch.float32)), visual_aug, seed).to(device)
              for z in payload.get("cond_video_latents", [])]
    audio = [_augmented(audio_to_rows(z.to(torch.float32)), audio_aug, seed + 1).to(device)
             for z in payload.get("cond_audio_latents", [])]
    return (torch.cat(visual) if visual else None), (torch.cat(audio) if audio else None)


def merge_rows(target: torch.Tensor, conditions: torch.Tensor | None,
               is_target: torch.Tensor) -> torch.Tensor:
    """Target rows and condition rows in sequence order (`is_target` marks the targets')."""
    if conditions is None:
        return target
    merged = torch.empty(is_target.shape[0], target.shape[1], dtype=torch.float32,
                         device=target.device)
    merged[~is_target] = conditions
    merged[is_target] = target
    return merged
