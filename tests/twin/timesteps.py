"""Per-row timesteps and the modulation rows they select.

The sampler hands the DiT the video sigma (timestep = 1000 * sigma). Rules:

- video and text rows run at t_v = 1 - sigma; audio rows at t_a = 1 - shift(sigma), where
  `shift` maps a sigma of the video schedule (shift 12) onto the audio schedule (shift 3) through
  the unshifted grid: s = x*k / (1 + (k - 1)*x) inverted for the first shift, re-applied for the
  second.
- condition / reference rows are nearly clean: visual ones at max(t_v, visual noise aug, 0.999
  by default), audio ones at max(t_a, audio noise aug, 1.0 by default).
- a denoise mask value m puts a row at sigma m * sigma_stream, i.e. t = 1 - m * sigma, capped at
  the stream's condition timestep; video masks are pooled per 2x2 patch (max).
- every distinct timestep m gets three modulation rows, 3m + tag (video 0, text 1, audio 2);
  text rows may carry per-token tags (vision pads modulate as video).

The result is a sorted list of distinct timesteps and `(start, stop, row)` segments, where row
is one index, or (masked streams) a LongTensor of indices per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .config import AUDIO_COND_T, TAG_AUDIO, TAG_TEXT, TAG_VIDEO, VISUAL_COND_T
from .layout import SequenceLayout

KIND_TAG = {"text": TAG_TEXT, "video": TAG_VIDEO, "cond": TAG_VIDEO, "ref_img": TAG_VIDEO,
            "audio": TAG_AUDIO, "cond_audio": TAG_AUDIO, "ref_audio": TAG_AUDIO}
FULLY_DENOISED = 1.0 - 1e-3  # mask values at or above this count as "generate"


def shift_sigma(sigma, from_shift: float, to_shift: float):
    """A sigma on a schedule shifted by `from_shift`, moved onto one shifted by `to_shift`."""
    unshifted = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * unshifted / (1.0 + (to_shift - 1.0) * unshifted)


def video_mask_per_patch(mask_THW: torch.Tensor, latent_t: int, lat_h: int,
                         lat_w: int) -> torch.Tensor | None:
    """[T, H, W] denoise mask -> one value per 2x2 patch row (max), None when all generate."""
    padded = F.pad(mask_THW, (0, lat_w - mask_THW.shape[-1], 0, lat_h - mask_THW.shape[-2]),
                   mode="replicate")
    pooled = padded.reshape(latent_t, lat_h // 2, 2, lat_w // 2, 2).amax(dim=(2, 4)).reshape(-1)
    return None if bool((pooled >= FULLY_DENOISED).all()) else pooled


@dataclass
class ModulationPlan:
    timesteps: list[float]  # distinct, ascending: row m of the time embedding
    mod_segments: list[tuple[int, int, Any]]  # rows 3m + tag
    video_seg: tuple[int, int, Any]  # rows m (the final layer has one modality)
    audio_seg: tuple[int, int, Any]


def stream_timesteps(sigma_v: float | torch.Tensor, shift_v: float,
                     shift_a: float) -> tuple[float, float]:
    """(t_v, t_a). A float sigma is shifted in float64 (the newest upstream files); an fp32
    tensor sigma in fp32, rounded there (ComfyUI 0.33.0: `TwinConfig.sigma_math`)."""
    return float(1.0 - sigma_v), float(1.0 - shift_sigma(sigma_v, shift_v, shift_a))


def plan_modulation(layout: SequenceLayout, sigma_v: float | torch.Tensor,
                    shifts: tuple[float, float], payload: dict,
                    denoise_mask: torch.Tensor | None,
                    audio_denoise_mask: torch.Tensor | None) -> ModulationPlan:
    t_v, t_a = stream_timesteps(sigma_v, *shifts)
    sigma_v = float(sigma_v)  # the masked rows' arithmetic below is the newest files' (floats)
    visual_cond = max(t_v, float(payload.get("visual_cond_noise_aug", VISUAL_COND_T)))
    audio_cond = max(t_a, float(payload.get("audio_cond_noise_aug", AUDIO_COND_T)))
    kind_t = {"text": t_v, "video": t_v, "audio": t_a, "cond": visual_cond,
              "ref_img": visual_cond, "cond_audio": audio_cond, "ref_audio": audio_cond}

    per_row: dict[str, torch.Tensor] = {}
    if denoise_mask is not None:
        _, latent_t, lat_h, lat_w, _ = layout.signature
        values = video_mask_per_patch(denoise_mask[0, 0].to(torch.float32), latent_t, lat_h,
                                      lat_w)
        if values is not None:
            _masked_rows(per_row, kind_t, "video", values, sigma_v, max(t_v, VISUAL_COND_T))
    if audio_denoise_mask is not None:
        values = audio_denoise_mask[0, 0].to(torch.float32).reshape(-1)
        if not bool((values >= FULLY_DENOISED).all()):
            _masked_rows(per_row, kind_t, "audio", values, 1.0 - t_a, max(t_a, AUDIO_COND_T))

    distinct = {t_v, t_a} | {kind_t[kind] for _, _, kind in layout.segments}
    for rows_t in per_row.values():
        distinct |= set(rows_t.unique().tolist())
    timesteps = sorted(distinct)
    index = {t: i for i, t in enumerate(timesteps)}

    def rows_index(rows_t: torch.Tensor, tag: int) -> torch.Tensor:
        levels = rows_t.unique()
        per_level = torch.tensor([index[t] * 3 + tag for t in levels.tolist()],
                                 dtype=torch.long, device=rows_t.device)
        return per_level[torch.searchsorted(levels, rows_t)]

    tags = _text_tags(payload)
    mod_segments: list[tuple[int, int, Any]] = []
    for a, b, kind in layout.segments:
        base = index[kind_t[kind]] * 3
        if kind == "text" and tags is not None:
            mod_segments += [(a + lo, a + hi, base + tag) for lo, hi, tag in _runs(tags[:b - a])]
        elif kind in per_row:
            mod_segments.append((a, b, rows_index(per_row[kind], KIND_TAG[kind])))
        else:
            mod_segments.append((a, b, base + KIND_TAG[kind]))

    def final_seg(kind: str) -> tuple[int, int, Any]:
        a, b = layout.span(kind)
        if kind in per_row:
            return a, b, rows_index(per_row[kind], 0) // 3
        return a, b, index[kind_t[kind]]

    return ModulationPlan(timesteps, mod_segments, final_seg("video"), final_seg("audio"))


def _masked_rows(per_row: dict, kind_t: dict, kind: str, values: torch.Tensor, sigma: float,
                 cap: float) -> None:
    rows_t = (1.0 - values * sigma).clamp(max=cap)
    if rows_t.unique().numel() == 1:
        kind_t[kind] = float(rows_t[0])  # one level: a plain segment at that timestep
    else:
        per_row[kind] = rows_t


def _text_tags(payload: dict) -> list[int] | None:
    tags = payload.get("_text_token_tags_list")
    if tags is None and payload.get("text_token_tags") is not None:
        # read to the host once per sampling run, not once per step
        tags = payload["text_token_tags"].view(-1).tolist()
        payload["_text_token_tags_list"] = tags
    return tags


def _runs(tags: list[int]) -> list[tuple[int, int, int]]:
    """[(start, stop, tag)] of the maximal runs of equal tags."""
    runs, start = [], 0
    for i in range(1, len(tags) + 1):
        if i == len(tags) or tags[i] != tags[start]:
            runs.append((start, i, int(tags[start])))
            start = i
    return runs
