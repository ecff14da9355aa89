"""The twin's top-level DiT: the sampler-facing forward, packing, and the block loop.

`MiniMaxH3Twin.forward(x=[video, audio], timestep, context, transformer_options,
minimax_payload=None, denoise_mask=None, audio_denoise_mask=None)` does what upstream's does:

1. the sampler carries the audio latent scaled by sigma_a / sigma_v (payload "audio_scale" != 1):
   undo that before the network and turn the velocity back into one of the carried variable
   after it, outside the DIFFUSION_MODEL wrappers;
2. `_forward` (inside the wrappers) packs `[text | cond/ref rows | audio | video]` (the layout
   prebuilt once per sampling run in the payload, else built here), runs the token refiner when
   the context still has the text encoder's width, embeds the distinct timesteps, builds the
   rotation table, runs every block or its `patches_replace["dit"][("double_block", i)]` patch
   (args img, t_emb, mod_segments, rope_freqs, layout, transformer_options; the block accepts
   `attention=`), then the output heads;
3. masked rows' velocities are scaled by their mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .config import TwinConfig
from .layout import SequenceLayout
from .model import DiTBlock, FinalLayer, TimeEmbedder, TokenRefiner, _layers
from .packing import (
    audio_to_rows,
    condition_rows,
    merge_rows,
    pad_to_even,
    rows_to_audio,
    rows_to_video,
    video_to_rows,
)
from .rope import axis_inverse_frequencies, rope_rotation_table
from .timesteps import plan_modulation, shift_sigma

DIFFUSION_MODEL_WRAPPER = "diffusion_model"  # ComfyUI's WrappersMP.DIFFUSION_MODEL value
SHIFT_KEYS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio")


@dataclass
class PackedInputs:
    """Everything the block loop and the output heads consume; built once per forward."""

    h: torch.Tensor  # [S, C] residual stream
    t_emb: torch.Tensor  # [M, t_dim]
    mod_segments: list[tuple[int, int, Any]]
    rope_freqs: torch.Tensor  # [1, S, 1, rot/2, 2, 2]
    video_seg: tuple[int, int, Any]
    audio_seg: tuple[int, int, Any]
    video_thw: tuple[int, int, int]  # patch grid of the (padded) target video
    layout: SequenceLayout
    crop_thw: tuple[int, int, int]  # the caller's latent size


class MiniMaxH3Twin(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype: torch.dtype | None = None, device=None,
                 operations=None):
        super().__init__()
        ops = _layers(operations)
        self.cfg = cfg
        self.dtype = dtype if dtype is not None else torch.float32
        self.hidden_size = cfg.hidden
        self.patch_size = (1, 2, 2)
        self.latents_dim = cfg.latents_dim
        self.sigma_shift_video = cfg.sigma_shift_video
        self.sigma_shift_audio = cfg.sigma_shift_audio
        self.use_adaln_curves = cfg.pruned_adaln
        self.video_patch_proj = ops.Linear(cfg.latents_dim * 4, cfg.hidden, bias=True,
                                           dtype=torch.float32, device=device)
        self.audio_patch_proj = ops.Linear(cfg.audio_latents_dim, cfg.hidden, bias=True,
                                           dtype=torch.float32, device=device)
        self.condition_proj = ops.Linear(cfg.text_dim, cfg.hidden, bias=True, dtype=dtype,
                                         device=device)
        if cfg.pruned_adaln:
            self.register_buffer("adaln_t_table", torch.empty(
                cfg.adaln_grid, cfg.t_dim, dtype=torch.float32, device=device))
        else:
            self.time_embedder = TimeEmbedder(cfg, device=device, operations=operations)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(
            cfg.rope_freqs_per_axis, dtype=torch.float32, device=device))
        self.token_refiner = TokenRefiner(cfg, dtype=dtype, device=device, operations=operations)
        self.blocks = nn.ModuleList([DiTBlock(cfg, dtype=dtype, device=device,
                                              operations=operations)
                                     for _ in range(cfg.blocks)])
        self.final_layer = FinalLayer(cfg, dtype=dtype, device=device, operations=operations)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def randomize_(self, seed: int = 0, on_device: bool = False) -> MiniMaxH3Twin:
        """Fill every parameter and buffer with small random values (deterministic per seed).

        Scales keep the residual stream O(1) over 50 blocks so numerical comparisons stay
        meaningful: linears ~ N(0, 1/fan_in), norms 1, AdaLN gates small. By default values are
        drawn on the CPU so they do not depend on the device; `on_device=True` draws them on
        the parameters' device (seconds instead of minutes for the full-size twin on a GPU).
        """
        cpu = torch.Generator(device="cpu").manual_seed(seed)
        for index, (name, p) in enumerate(self.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
                continue
            std = (1.0 / p.shape[-1]) ** 0.5 if p.ndim > 1 else 0.02
            std *= 0.1 if "adaln_proj" in name else 1.0
            if on_device:
                gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + index)
                p.normal_(0.0, std, generator=gen)
                continue
            flat = p.view(-1)
            step = 1 << 24  # CPU chunks: values independent of the device
            for start in range(0, flat.numel(), step):
                n = min(step, flat.numel() - start)
                chunk = torch.randn(n, generator=cpu, dtype=torch.float32) * std
                flat[start:start + n].copy_(chunk.to(flat.device, flat.dtype))
        if self.use_adaln_curves:
            table = torch.randn(self.adaln_t_table.shape, generator=cpu)
            self.adaln_t_table.copy_(table.to(self.adaln_t_table.device))
        self.rope.inv_freq.copy_(axis_inverse_frequencies(self.cfg.rope_freqs_per_axis)
                                 .to(self.rope.inv_freq.device))
        return self

    # ------------------------------------------------------------------ conditioning
    def preprocess_text_embeds(self, text_states: torch.Tensor) -> torch.Tensor:
        """[1, L, text_dim] encoder states -> [1, L, C] refined (once per sampling run)."""
        if text_states.shape[-1] == self.hidden_size:
            return text_states
        return self.token_refiner(self.condition_proj(text_states[0])).unsqueeze(0)

    def time_embedding(self, timesteps: list[float], device, dtype) -> torch.Tensor:
        t_M = torch.tensor(timesteps, dtype=torch.float32, device=device)
        if not self.use_adaln_curves:
            return self.time_embedder(t_M).to(dtype)
        table = self.adaln_t_table.to(device)
        # t in [0, 1] -> fractional row of the table; t = 1 interpolates on the last interval
        where = t_M.clamp(0.0, 1.0) * (table.shape[0] - 1)
        lower = where.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[lower], table[lower + 1], (where - lower).unsqueeze(1))

    def rope_table(self, position_ids: torch.Tensor, device, dtype) -> torch.Tensor:
        """[S, 3] float64 (t, h, w) -> [1, S, 1, 3n, 2, 2] rotations, n frequencies per axis."""
        pos = position_ids.to(torch.float32).to(device)
        per_axis = pos.unsqueeze(-1) * self.rope.inv_freq.to(device).view(1, 1, -1)
        half = torch.cat(per_axis.unbind(dim=1), dim=-1)
        return rope_rotation_table(torch.cat((half, half), dim=-1), dtype)

    # ------------------------------------------------------------------ packing
    def pack(self, x: list[torch.Tensor], timestep: torch.Tensor, context: torch.Tensor,
             transformer_options: dict, minimax_payload: dict | None = None,
             denoise_mask: torch.Tensor | None = None,
             audio_denoise_mask: torch.Tensor | None = None) -> PackedInputs:
        crop_thw = tuple(x[0].shape[2:5])
        video, audio = pad_to_even(x[0]), x[1]
        if video.shape[0] != 1:
            raise ValueError("MiniMax H3 supports batch size 1")
        payload = minimax_payload or {}
        device, dtype = video.device, context.dtype
        latent_t, lat_h, lat_w = video.shape[2:5]
        signature = (context.shape[1], latent_t, lat_h, lat_w, audio.shape[-1])
        layout = payload.get("layout")
        if layout is None or layout.signature != signature:
            layout = SequenceLayout(*signature, keyframes=payload.get("keyframes"),
                                    refs=payload.get("refs"))
        transformer_options["minimax_h3_layout"] = layout

        shifts = self._shifts(transformer_options)
        sigma_t = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        sigma_v = float(sigma_t) if self.cfg.sigma_math == "float" else sigma_t
        plan = plan_modulation(layout, sigma_v, shifts, payload, denoise_mask,
                               audio_denoise_mask)

        cond_video, cond_audio = condition_rows(payload, device)
        video_rows = merge_rows(video_to_rows(video.to(torch.float32)), cond_video,
                                layout.img_update.to(device))
        audio_rows = merge_rows(audio_to_rows(audio.to(torch.float32)), cond_audio,
                                layout.audio_update.to(device))
        video_embed = self.video_patch_proj(video_rows).to(dtype)
        audio_embed = self.audio_patch_proj(audio_rows).to(dtype)
        text = context[0]
        if text.shape[-1] != self.hidden_size:  # not refined in the conditioning: do it here
            text = self.token_refiner(self.condition_proj(text),
                                      transformer_options=transformer_options)

        h = torch.empty(layout.seq_len, self.hidden_size, dtype=dtype, device=device)
        taken = {"video": 0, "audio": 0}
        for a, b, kind in layout.segments:
            if kind == "text":
                h[a:b] = text
                continue
            stream = "video" if kind in ("cond", "ref_img", "video") else "audio"
            source = video_embed if stream == "video" else audio_embed
            h[a:b] = source[taken[stream]:taken[stream] + b - a]
            taken[stream] += b - a

        return PackedInputs(
            h=h, t_emb=self.time_embedding(plan.timesteps, device, dtype),
            mod_segments=plan.mod_segments,
            rope_freqs=self.rope_table(layout.position_ids, device, dtype),
            video_seg=plan.video_seg, audio_seg=plan.audio_seg,
            video_thw=(latent_t, lat_h // 2, lat_w // 2), layout=layout, crop_thw=crop_thw)

    def _shifts(self, transformer_options: dict) -> tuple[float, float]:
        return (float(transformer_options.get(SHIFT_KEYS[0], self.sigma_shift_video)),
                float(transformer_options.get(SHIFT_KEYS[1], self.sigma_shift_audio)))

    # ------------------------------------------------------------------ blocks
    def run_blocks(self, packed: PackedInputs, transformer_options: dict) -> torch.Tensor:
        h = packed.h
        replaced = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            patch = replaced.get(("double_block", i))
            if patch is None:
                h = block(h, packed.t_emb, packed.mod_segments, packed.rope_freqs,
                          transformer_options=transformer_options)
                continue

            def original_block(args, block=block):
                return {"img": block(args["img"], args["t_emb"], args["mod_segments"],
                                     args["rope_freqs"],
                                     transformer_options=args["transformer_options"],
                                     attention=args.get("attention"))}

            args = {"img": h, "t_emb": packed.t_emb, "mod_segments": packed.mod_segments,
                    "rope_freqs": packed.rope_freqs, "layout": packed.layout,
                    "transformer_options": transformer_options}
            h = patch(args, {"original_block": original_block})["img"]
        return h

    # ------------------------------------------------------------------ forward
    def _forward(self, x, timestep, context, transformer_options, minimax_payload=None,
                 denoise_mask=None, audio_denoise_mask=None, **kwargs):
        packed = self.pack(x, timestep, context, transformer_options, minimax_payload,
                           denoise_mask, audio_denoise_mask)
        h = self.run_blocks(packed, transformer_options)
        v, a = self.final_layer(h, packed.t_emb, packed.video_seg, packed.audio_seg)
        t, hh, ww = packed.video_thw
        video = rows_to_video(v, t, hh, ww, self.latents_dim)
        crop_t, crop_h, crop_w = packed.crop_thw
        video = video[:, :, :crop_t, :crop_h, :crop_w]
        return [-video.to(x[0].dtype), -rows_to_audio(a).to(x[1].dtype)]

    def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None,
                denoise_mask=None, audio_denoise_mask=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        scale = float((minimax_payload or {}).get("audio_scale", 1.0))
        carried = x[1]
        if scale != 1.0:
            # the sampler carries audio * sigma_v / sigma_a: hand the network the audio latent
            sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
            sigma_a = shift_sigma(sigma_v, *self._shifts(transformer_options))
            factor = (sigma_a / sigma_v).to(carried.dtype)
            x = [x[0], carried * factor]
        wrappers = _wrappers(transformer_options, DIFFUSION_MODEL_WRAPPER)
        out = WrapperChain(self._forward, self, wrappers).execute(
            x, timestep, context, transformer_options, minimax_payload=minimax_payload,
            denoise_mask=denoise_mask, audio_denoise_mask=audio_denoise_mask, **kwargs)
        # a masked row was predicted at mask * sigma: scale its velocity to the outer step
        if denoise_mask is not None:
            out[0] = out[0] * denoise_mask
        if audio_denoise_mask is not None:
            out[1] = out[1] * audio_denoise_mask
        if scale != 1.0:
            # velocity of the carried variable: d/d(sigma_v) of audio * sigma_a / (sigma_v s)
            out[1] = ((1.0 - scale) * (carried * factor)
                      + (1.0 + (scale - 1.0) * sigma_a).to(out[1].dtype) * out[1])
        return out


def _wrappers(transformer_options: dict, kind: str) -> list[Callable[..., Any]]:
    by_key = transformer_options.get("wrappers", {}).get(kind, {})
    return [fn for fns in by_key.values() for fn in fns]


class WrapperChain:
    """ComfyUI's WrapperExecutor contract: wrapper(executor, *args, **kwargs), where
    `executor(*args, **kwargs)` runs the next wrapper (or the wrapped function) and
    `executor.class_obj` is the model."""

    def __init__(self, inner: Callable[..., Any], class_obj: Any,
                 wrappers: list[Callable[..., Any]], index: int = 0):
        self.inner, self.class_obj, self.wrappers, self.index = inner, class_obj, wrappers, index

    def __call__(self, *args, **kwargs):
        return WrapperChain(self.inner, self.class_obj, self.wrappers, self.index + 1).execute(
            *args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.index == len(self.wrappers):
            return self.inner(*args, **kwargs)
        return self.wrappers[self.index](self, *args, **kwargs)
