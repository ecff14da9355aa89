"""Building twins, their inputs, and the conditioning ComfyUI prepares once per sampling run.

`make_conditioning` is the twin's side of upstream's `MiniMaxH3.extra_conds`: it refines the
text once (token refiner outside any DiT forward), gathers keyframe / reference latents into
the payload, records the audio carry scale and prebuilds the sequence layout, returning the
keyword arguments the sampler passes to every forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F

from . import model as layers
from .attention import ComfyAttention
from .config import TwinConfig
from .dit import MiniMaxH3Twin
from .layout import SequenceLayout


def make_twin(cfg: TwinConfig, *, dtype: torch.dtype = torch.float32, device="cpu",
              seed: int = 0, init_on_device: bool = False, operations=None) -> MiniMaxH3Twin:
    """Build and randomize a twin; `device="meta"` builds shapes only.

    `init_on_device=True` draws the random weights on `device` (fast for the full-size twin on
    a GPU; the values then depend on the device type, which timing does not care about).
    `operations`: layer classes (e.g. `comfy.ops.disable_weight_init`); plain torch.nn if None.
    """
    model = MiniMaxH3Twin(cfg, dtype=dtype, device=device, operations=operations)
    if str(device) != "meta":
        model.randomize_(seed, on_device=init_on_device)
    return model.eval().requires_grad_(False)


def make_inputs(cfg: TwinConfig, *, latent_t: int, latent_h: int, latent_w: int,
                audio_t: int, text_len: int = 16, dtype: torch.dtype = torch.float32,
                device="cpu", seed: int = 0, sigma: float = 0.7):
    """Random (x, timestep, context) for one forward; the context has the encoder's width."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    video = torch.randn(1, cfg.latents_dim, latent_t, latent_h, latent_w, generator=gen)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, audio_t, generator=gen)
    context = torch.randn(1, text_len, cfg.text_dim, generator=gen)
    return ([video.to(device), audio.to(device)],
            torch.tensor([sigma * 1000.0], device=device),
            context.to(device, dtype))


@torch.no_grad()
def make_conditioning(model: MiniMaxH3Twin, context: torch.Tensor, x: list[torch.Tensor], *,
                      keyframes: list[dict] | None = None, refs: list[dict] | None = None,
                      audio_scale: float = 1.0, seed: int = 0,
                      text_token_tags: torch.Tensor | None = None,
                      visual_cond_noise_aug: float | None = None,
                      audio_cond_noise_aug: float | None = None,
                      denoise_masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """{"context": refined text, "minimax_payload": {...}} for `model(x, timestep, **this)`.

    keyframes: dicts with "resolved_frame_index" (pixel frame) and "latent" `[1, c, t, H, W]`
    and/or "audio_latent" `[1, c, 2, T]`. refs: dicts with "kind" (image / audio / video /
    video_audio), "latent_h", "latent_w", "latent_t", "ref_audio_t", "latent", "audio_latent".
    `audio_scale`: the scale the sampler carries the audio latent at (sigma shift video / audio
    when sampling the packed audio-video latent, else 1). `denoise_masks`: (video, audio)
    per-pixel masks, see `mask_conditioning`.
    """
    refined = model.preprocess_text_embeds(context)
    payload: dict = {}
    if text_token_tags is not None:
        payload["text_token_tags"] = text_token_tags
    if keyframes is not None:
        payload["keyframes"] = keyframes
        payload["cond_video_latents"] = [k["latent"] for k in keyframes
                                         if k.get("latent") is not None]
        payload["cond_audio_latents"] = [k["audio_latent"] for k in keyframes
                                         if k.get("audio_latent") is not None]
    if refs is not None:
        payload["refs"] = refs
        payload["cond_video_latents"] = payload.get("cond_video_latents", []) + [
            r["latent"] for r in refs if "latent" in r]
        payload["cond_audio_latents"] = payload.get("cond_audio_latents", []) + [
            r["audio_latent"] for r in refs if r.get("audio_latent") is not None]
    if visual_cond_noise_aug is not None:
        payload["visual_cond_noise_aug"] = visual_cond_noise_aug
    if audio_cond_noise_aug is not None:
        payload["audio_cond_noise_aug"] = audio_cond_noise_aug
    payload["seed"] = seed
    payload["audio_scale"] = audio_scale
    out: dict = {}
    if denoise_masks is not None:
        out.update(mask_conditioning(*denoise_masks))
    video_shape, audio_shape = x[0].shape, x[1].shape
    payload["layout"] = SequenceLayout(
        refined.shape[1], video_shape[2], (video_shape[3] + 1) // 2 * 2,
        (video_shape[4] + 1) // 2 * 2, audio_shape[-1], keyframes=payload.get("keyframes"),
        refs=payload.get("refs"))
    return {**out, "context": refined, "minimax_payload": payload}


LABEL_STEPS = 256.0  # mask labels are rounded up to 1/256


def mask_conditioning(video_mask: torch.Tensor, audio_mask: torch.Tensor) -> dict:
    """Per-pixel denoise masks -> the forward's `denoise_mask` / `audio_denoise_mask`.

    video_mask `[1, c, T, H, W]`, audio_mask `[1, c, 2, T]`, 1 = generate. A video mask is
    pooled to its 2x2 patches (max, edges replicated), an audio mask over channels (max); both
    are rounded up to 1/256. A stream whose mask generates everywhere gets no entry.
    """
    h, w = video_mask.shape[-2:]
    padded = F.pad(video_mask.reshape((-1,) + video_mask.shape[-3:]), (0, w % 2, 0, h % 2),
                   mode="replicate").reshape(video_mask.shape[:-2] + (h + h % 2, w + w % 2))
    pooled = padded.reshape(padded.shape[:-2] + ((h + 1) // 2, 2, (w + 1) // 2, 2)).amax(
        dim=(-3, -1))
    video = pooled.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)[..., :h, :w]
    audio = audio_mask.amax(dim=1, keepdim=True).expand_as(audio_mask)
    video, audio = (torch.ceil(m * LABEL_STEPS) / LABEL_STEPS for m in (video, audio))
    out = {}
    if torch.amin(video).item() < 1.0 - 1e-3:
        out["denoise_mask"] = video[:1, :1].clone()
    if torch.amin(audio).item() < 1.0 - 1e-3:
        out["audio_denoise_mask"] = audio[:1].amax(dim=1, keepdim=True)
    return out


def select_checkpoint_attention(model: torch.nn.Module, method: str | None,
                                device: torch.device | None = None) -> int:
    """Every attention module as if the checkpoint's `comfy_attention.config` named `method`
    ("comfy_kitchen_int8": comfy-kitchen's INT8 attention where it runs on `device`).
    Returns how many modules got a preferred function."""
    slots = [m for m in model.modules() if isinstance(m, ComfyAttention)]
    for slot in slots:
        slot.select(method, device)
    return sum(slot.function is not None for slot in slots)


@contextlib.contextmanager
def comfyui_attention(attention_module: ModuleType) -> Iterator[None]:
    """Within the block, twin attention goes through ComfyUI's own dispatch and kernels.

    `attention_module` is `comfy.ldm.modules.attention`: its `optimized_attention` (the kernel
    ComfyUI picked for this machine: sub-quadratic on CPU, SDPA with its backend priority on
    CUDA, or sage / flash / xformers by flag) and its `AttentionTensorContainer` replace the
    twin's, exactly as upstream H3 imports them. The chunked block forward looks them up on the
    twin's module at call time, so it follows too.
    """
    saved = (layers.optimized_attention, layers.AttentionTensorContainer)
    layers.optimized_attention = attention_module.optimized_attention
    layers.AttentionTensorContainer = attention_module.AttentionTensorContainer
    try:
        yield
    finally:
        layers.optimized_attention, layers.AttentionTensorContainer = saved
