"""The twin's top-level DiT: packing, time embedding, RoPE table, the block loop.

`MiniMaxH3Twin.forward(x=[video, audio], timestep, context, transformer_options)` follows
upstream's `forward`/`_forward`: DIFFUSION_MODEL wrappers around `_forward`, the packed sequence
`[text | audio | video]` with one modulation row per (segment, timestep), the rotation table
computed once per forward, and per block either the block itself or
`patches_replace["dit"][("double_block", i)]` with upstream's `args`/`original_block` contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .model import DiTBlock, FinalLayer, Segments, TokenRefiner, TwinConfig
from .rope import axis_inverse_frequencies, rope_rotation_table

DIFFUSION_MODEL_WRAPPER = "diffusion_model"  # ComfyUI's WrappersMP.DIFFUSION_MODEL value


def _patchify(video_BCTHW: torch.Tensor) -> torch.Tensor:
    b, c, t, h, w = video_BCTHW.shape
    x = video_BCTHW.reshape(b, c, t, h // 2, 2, w // 2, 2)
    x = x.permute(0, 2, 3, 5, 1, 4, 6)  # b t h w c ph pw
    return x.reshape(b * t * (h // 2) * (w // 2), c * 4)


def _unpatchify(rows: torch.Tensor, t: int, h: int, w: int, c: int) -> torch.Tensor:
    x = rows.reshape(1, t, h, w, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(1, c, t, h * 2, w * 2)


def _pack_audio(audio_BCKT: torch.Tensor) -> torch.Tensor:
    # [1, 32, 2, T] -> [2T, 32], left channel rows then right channel rows
    return audio_BCKT[0].permute(1, 2, 0).reshape(-1, audio_BCKT.shape[1])


def _unpack_audio(rows: torch.Tensor) -> torch.Tensor:
    t = rows.shape[0] // 2
    return rows.reshape(2, t, rows.shape[-1]).permute(2, 0, 1).unsqueeze(0)


@dataclass
class PackedInputs:
    """Everything the block loop consumes; built once per forward."""

    h: torch.Tensor  # [S, C] residual stream
    t_emb: torch.Tensor  # [rows, t_dim] fp32
    mod_segments: Segments
    rope_freqs: torch.Tensor  # [1, S, 1, rot/2, 2, 2]
    video_seg: tuple[int, int, int]
    audio_seg: tuple[int, int, int]
    video_thw: tuple[int, int, int]


class MiniMaxH3Twin(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype if dtype is not None else torch.float32
        self.hidden_size = cfg.hidden
        self.video_patch_proj = nn.Linear(cfg.latents_dim * 4, cfg.hidden, bias=True,
                                          dtype=torch.float32, device=device)
        self.audio_patch_proj = nn.Linear(cfg.audio_latents_dim, cfg.hidden, bias=True,
                                          dtype=torch.float32, device=device)
        self.condition_proj = nn.Linear(cfg.text_dim, cfg.hidden, bias=True, dtype=dtype,
                                        device=device)
        self.register_buffer("adaln_t_table",
                             torch.empty(cfg.adaln_grid, cfg.t_dim, dtype=torch.float32,
                                         device=device))
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(cfg.rope_freqs_per_axis,
                                                          dtype=torch.float32, device=device))
        self.token_refiner = TokenRefiner(cfg, dtype=dtype, device=device)
        self.blocks = nn.ModuleList([DiTBlock(cfg, dtype=dtype, device=device)
                                     for _ in range(cfg.blocks)])
        self.final_layer = FinalLayer(cfg, dtype=dtype, device=device)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def randomize_(self, seed: int = 0, on_device: bool = False) -> MiniMaxH3Twin:
        """Fill every parameter with small random values (deterministic per seed).

        Scales keep the residual stream O(1) over 50 blocks so numerical comparisons stay
        meaningful: linears ~ N(0, 1/fan_in), norms 1, AdaLN gates small. By default values are
        drawn on the CPU so they do not depend on the device; `on_device=True` draws them on
        the parameters' device (seconds instead of minutes for the full-size twin on a GPU).
        """
        if on_device:
            return self._randomize_on_device_(seed)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            fan_in = p.shape[-1] if p.ndim > 1 else 1
            std = (1.0 / fan_in) ** 0.5 if p.ndim > 1 else 0.02
            if "adaln_proj" in name:
                std *= 0.1
            # generate on CPU in chunks so the values do not depend on the device
            flat = p.view(-1)
            step = 1 << 24
            for start in range(0, flat.numel(), step):
                n = min(step, flat.numel() - start)
                chunk = torch.randn(n, generator=gen, dtype=torch.float32) * std
                flat[start:start + n].copy_(chunk.to(flat.device, flat.dtype))
        table = torch.randn(self.adaln_t_table.shape, generator=gen)
        self.adaln_t_table.copy_(table.to(self.adaln_t_table.device))
        self.rope.inv_freq.copy_(axis_inverse_frequencies(self.cfg.rope_freqs_per_axis)
                                 .to(self.rope.inv_freq.device))
        return self

    def _randomize_on_device_(self, seed: int) -> MiniMaxH3Twin:
        for index, (name, p) in enumerate(self.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + index)
            std = (1.0 / p.shape[-1]) ** 0.5 if p.ndim > 1 else 0.02
            if "adaln_proj" in name:
                std *= 0.1
            p.normal_(0.0, std, generator=gen)
        gen = torch.Generator(device=self.adaln_t_table.device).manual_seed(seed)
        self.adaln_t_table.normal_(generator=gen)
        self.rope.inv_freq.copy_(axis_inverse_frequencies(self.cfg.rope_freqs_per_axis)
                                 .to(self.rope.inv_freq.device))
        return self

    # ------------------------------------------------------------------ packing
    def _t_emb(self, t_values: torch.Tensor) -> torch.Tensor:
        table = self.adaln_t_table
        pos = t_values.clamp(0.0, 1.0) * (table.shape[0] - 1)
        i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))

    def _positions(self, text_len: int, audio_t: int, t: int, h: int, w: int,
                   device) -> torch.Tensor:
        """[S, 3] (t, h, w) coordinates: text on t, audio on t at the w extremes, video grid."""
        text = torch.zeros(text_len, 3)
        text[:, 0] = torch.arange(text_len)
        audio = torch.zeros(audio_t * 2, 3)
        audio[:, 0] = (text_len + torch.arange(audio_t)).repeat(2).float()
        audio[:audio_t, 2] = 0.0
        audio[audio_t:, 2] = float(w)
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                    indexing="ij")
        video = torch.stack([tt.reshape(-1) * (5.0 / 3.0) + text_len, hh.reshape(-1).float(),
                             ww.reshape(-1).float()], dim=-1)
        return torch.cat([text, audio, video]).to(device)

    def _rope_table(self, pos_S3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        inv = self.rope.inv_freq.to(pos_S3.device)
        per_axis = pos_S3.float().unsqueeze(-1) * inv.view(1, 1, -1)
        half = torch.cat(per_axis.unbind(dim=1), dim=-1)
        return rope_rotation_table(torch.cat((half, half), dim=-1), dtype)

    def pack(self, x: list[torch.Tensor], timestep: torch.Tensor, context: torch.Tensor,
             transformer_options: dict) -> PackedInputs:
        video, audio = x[0], x[1]
        if video.shape[0] != 1:
            raise ValueError("MiniMax H3 supports batch size 1")
        device = video.device
        dtype = context.dtype
        _, _, t, lh, lw = video.shape
        audio_t = audio.shape[-1]
        sigma = float((timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
        t_v = 1.0 - sigma
        t_a = 1.0 - sigma / (3.0 + sigma * (1.0 - 3.0))  # audio on its own shifted schedule
        unique_t = sorted({t_v, t_a})
        t_row = {v: i for i, v in enumerate(unique_t)}
        t_emb = self._t_emb(torch.tensor(unique_t, dtype=torch.float32, device=device))

        text_states = context[0]
        if text_states.shape[-1] != self.hidden_size:
            text_states = self.token_refiner(self.condition_proj(text_states),
                                             transformer_options=transformer_options)
        text_len = text_states.shape[0]
        video_rows = self.video_patch_proj(_patchify(video.float())).to(dtype)
        audio_rows = self.audio_patch_proj(_pack_audio(audio.float())).to(dtype)
        s = text_len + audio_rows.shape[0] + video_rows.shape[0]
        h = torch.empty(s, self.hidden_size, dtype=dtype, device=device)
        a0, v0 = text_len, text_len + audio_rows.shape[0]
        h[:a0] = text_states
        h[a0:v0] = audio_rows
        h[v0:] = video_rows
        # modulation rows: 3 per timestep (tags video 0, text 1, audio 2)
        mod_segments = [(0, a0, t_row[t_v] * 3 + 1), (a0, v0, t_row[t_a] * 3 + 2),
                        (v0, s, t_row[t_v] * 3 + 0)]
        pos = self._positions(text_len, audio_t, t, lh // 2, lw // 2, device)
        transformer_options["minimax_h3_layout"] = [(0, a0, "text"), (a0, v0, "audio"),
                                                     (v0, s, "video")]
        return PackedInputs(h=h, t_emb=t_emb, mod_segments=mod_segments,
                            rope_freqs=self._rope_table(pos, dtype),
                            video_seg=(v0, s, t_row[t_v]), audio_seg=(a0, v0, t_row[t_a]),
                            video_thw=(t, lh // 2, lw // 2))

    # ------------------------------------------------------------------ blocks
    def run_blocks(self, packed: PackedInputs, transformer_options: dict) -> torch.Tensor:
        h = packed.h
        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            if ("double_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    return {"img": block(args["img"], args["t_emb"], args["mod_segments"],
                                         args["rope_freqs"],
                                         transformer_options=args["transformer_options"],
                                         attention=args.get("attention"))}
                h = blocks_replace[("double_block", i)](
                    {"img": h, "t_emb": packed.t_emb, "mod_segments": packed.mod_segments,
                     "rope_freqs": packed.rope_freqs, "transformer_options": transformer_options},
                    {"original_block": block_wrap})["img"]
            else:
                h = block(h, packed.t_emb, packed.mod_segments, packed.rope_freqs,
                          transformer_options=transformer_options)
        return h

    def _forward(self, x, timestep, context, transformer_options, **kwargs):
        packed = self.pack(x, timestep, context, transformer_options)
        h = self.run_blocks(packed, transformer_options)
        v, a = self.final_layer(h, packed.t_emb, packed.video_seg, packed.audio_seg)
        t, hh, ww = packed.video_thw
        return [-_unpatchify(v, t, hh, ww, self.cfg.latents_dim).to(x[0].dtype),
                -_unpack_audio(a).to(x[1].dtype)]

    def forward(self, x, timestep, context, transformer_options=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        wrappers = _wrappers(transformer_options, DIFFUSION_MODEL_WRAPPER)
        return _execute(wrappers, self._forward, x, timestep, context, transformer_options,
                        **kwargs)


def _wrappers(transformer_options: dict, kind: str) -> list[Callable[..., Any]]:
    by_key = transformer_options.get("wrappers", {}).get(kind, {})
    return [fn for fns in by_key.values() for fn in fns]


def _execute(wrappers: list[Callable[..., Any]], inner: Callable[..., Any], *args, **kwargs):
    """ComfyUI's WrapperExecutor contract: wrapper(executor, *args, **kwargs)."""
    if not wrappers:
        return inner(*args, **kwargs)

    def executor(*a, **kw):
        return _execute(wrappers[1:], inner, *a, **kw)

    return wrappers[0](executor, *args, **kwargs)


def make_twin(cfg: TwinConfig, *, dtype: torch.dtype = torch.float32, device="cpu",
              seed: int = 0, init_on_device: bool = False) -> MiniMaxH3Twin:
    """Build and randomize a twin; `device="meta"` builds shapes only.

    `init_on_device=True` draws the random weights on `device` (fast for the full-size twin on
    a GPU; the values then depend on the device type, which timing does not care about).
    """
    model = MiniMaxH3Twin(cfg, dtype=dtype, device=device)
    if str(device) != "meta":
        model.randomize_(seed, on_device=init_on_device)
    return model.eval().requires_grad_(False)


def make_inputs(cfg: TwinConfig, *, latent_t: int, latent_h: int, latent_w: int,
                audio_t: int, text_len: int = 16, dtype: torch.dtype = torch.float32,
                device="cpu", seed: int = 0, sigma: float = 0.7):
    """Random (x, timestep, context) for one forward of the twin."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    video = torch.randn(1, cfg.latents_dim, latent_t, latent_h, latent_w, generator=gen)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, audio_t, generator=gen)
    context = torch.randn(1, text_len, cfg.text_dim, generator=gen)
    return ([video.to(device), audio.to(device)],
            torch.tensor([sigma * 1000.0], device=device),
            context.to(device, dtype))
