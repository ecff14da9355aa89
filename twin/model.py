"""A structural twin of ComfyUI's MiniMax H3 DiT (`comfy/ldm/minimax/model.py`).

Same attribute paths (`blocks.N.attn.qkv_proj`, `q_norm`, `k_norm`, `out_proj`, `mlp.fc1`,
`mlp.fc2`, `adaln_proj`, `token_refiner.blocks.N`), the same shapes for a given config, the same
packed sequence `[text | audio | video]` with per-segment AdaLN modulation and in-place residual
updates, the same in-place q/k RMSNorm + split-half RoPE on the qkv buffer, and the same attention
call path (`optimized_attention` with `AttentionTensorContainer` inputs, honouring
`transformer_options["optimized_attention_override"]`) and block replacement
(`patches_replace["dit"][("double_block", i)]`). Random weights: it exists so every feature can be
tested and timed without the real checkpoint, and each feature must work unchanged on the real one.

Legend: S tokens of the packed sequence, C hidden width, H heads, D head dim, F ffn width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import geometry
from .attention import AttentionTensorContainer, ComfyAttention, optimized_attention
from .rope import rms_rope_split_half_


@dataclass(frozen=True)
class TwinConfig:
    hidden: int = geometry.HIDDEN
    heads: int = geometry.HEADS
    head_dim: int = geometry.HEAD_DIM
    ffn: int = geometry.FFN
    blocks: int = geometry.BLOCKS
    refiner_blocks: int = geometry.REFINER_BLOCKS
    text_dim: int = 5120
    latents_dim: int = 24
    audio_latents_dim: int = 32
    # pruned ("curve") checkpoints: AdaLN from a small fp32 basis of the time-embedding curve
    t_dim: int = 8
    adaln_grid: int = 64
    rope_freqs_per_axis: int = 16  # 3 axes x 16 x 2 = 96 rotated dims of 128
    eps: float = 1e-5

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @classmethod
    def full(cls, **overrides: Any) -> TwinConfig:
        """The upstream shapes: 50 blocks, 5376 hidden, 56x128 heads, FFN 14336."""
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> TwinConfig:
        """A CPU-sized twin with the same structure (8 heads so head splits are interesting)."""
        base = cls(hidden=64, heads=8, head_dim=16, ffn=96, blocks=3, refiner_blocks=1,
                   text_dim=48, t_dim=8, adaln_grid=16, rope_freqs_per_axis=2)
        return replace(base, **overrides)


class Attention(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.comfy_attention = ComfyAttention()
        self.heads = cfg.heads
        self.head_dim = cfg.head_dim
        inner = cfg.inner
        self.qkv_proj = nn.Linear(cfg.hidden, inner * 3, bias=False, dtype=dtype, device=device)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps, dtype=dtype, device=device)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps, dtype=dtype, device=device)
        self.out_proj = nn.Linear(inner, cfg.hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x_SC: torch.Tensor, rope_freqs: torch.Tensor | None = None,
                transformer_options: dict | None = None) -> torch.Tensor:
        transformer_options = {} if transformer_options is None else transformer_options
        s = x_SC.shape[0]
        q, k, v = self.qkv_proj(x_SC).split(self.heads * self.head_dim, dim=-1)
        v = v.view(s, self.heads, self.head_dim)
        if rope_freqs is not None:
            q = q.view(1, s, self.heads, self.head_dim)
            k = k.view(1, s, self.heads, self.head_dim)
            rot = rope_freqs.shape[-3] * 2
            rms_rope_split_half_(q, k, rope_freqs, self.q_norm.weight.to(x_SC.device),
                                 self.k_norm.weight.to(x_SC.device), self.q_norm.eps, rot)
            q, k = q[0], k[0]
        else:
            q = self.q_norm(q.view(s, self.heads, self.head_dim))
            k = self.k_norm(k.view(s, self.heads, self.head_dim))
        # strided [1, H, S, D] views of the qkv buffer, exactly as upstream hands them over
        q = AttentionTensorContainer(q.transpose(0, 1).unsqueeze(0))
        k = AttentionTensorContainer(k.transpose(0, 1).unsqueeze(0))
        v = AttentionTensorContainer(v.transpose(0, 1).unsqueeze(0))
        out = optimized_attention(q, k, v, self.heads, preferred_attention=self.comfy_attention,
                                  mask=None, skip_reshape=True,
                                  transformer_options=transformer_options)
        return self.out_proj(out.squeeze(0))


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """gate = first half of fc1's rows, up = second half: silu(gate) * up."""
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn * 2, bias=False, dtype=dtype, device=device)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x_SC: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x_SC)))


class AdalnProj(nn.Module):
    def __init__(self, t_dim: int, hidden: int, expand: int, modalities: int, device=None):
        super().__init__()
        self.expand = expand
        self.modalities = modalities
        self.hidden = hidden
        # curve-form checkpoints keep this projection in fp32 and skip the SiLU
        self.linear = nn.Linear(t_dim, expand * hidden * modalities, bias=True,
                                dtype=torch.float32, device=device)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.linear(t_emb.float())
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)


Segments = list[tuple[int, int, int]]  # (start, stop, modulation row)


def mod_scale_shift(h: torch.Tensor, shift, scale, segments: Segments) -> torch.Tensor:
    for a, b, row in segments:
        h[a:b].mul_(1.0 + scale[row].to(h.dtype)).add_(shift[row].to(h.dtype))
    return h


def mod_gate(x: torch.Tensor, gate, other: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Accumulate the gated branch output into the residual stream in place, per segment."""
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], gate[row].to(x.dtype))
    return x


class DiTBlock(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype=dtype, device=device)
        self.mlp = MLP(cfg, dtype=dtype, device=device)
        self.adaln_proj = AdalnProj(cfg.t_dim, cfg.hidden, 6, 3, device=device)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None,
                attention=None):
        transformer_options = {} if transformer_options is None else transformer_options
        attention = self.attn if attention is None else attention
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
        h = mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
        x = mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs,
                                            transformer_options=transformer_options),
                     mod_segments)
        h = mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)
        return mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


class RefinerBlock(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype=dtype, device=device)
        self.mlp = MLP(cfg, dtype=dtype, device=device)

    def forward(self, x, transformer_options=None):
        x = self.attn(self.norm1(x), transformer_options=transformer_options).add_(x)
        return self.mlp(self.norm2(x)).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.blocks = nn.ModuleList(
            [RefinerBlock(cfg, dtype=dtype, device=device) for _ in range(cfg.refiner_blocks)])
        self.final_norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)

    def forward(self, x, transformer_options=None):
        for block in self.blocks:
            x = block(x, transformer_options=transformer_options)
        return self.final_norm(x)


class FinalLayer(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.adaln_proj = AdalnProj(cfg.t_dim, cfg.hidden, 2, 1, device=device)
        video_dim = cfg.latents_dim * 4
        self.video_out = nn.Linear(cfg.hidden, video_dim, bias=True, dtype=torch.float32,
                                   device=device)
        self.audio_out = nn.Linear(cfg.hidden, cfg.audio_latents_dim, bias=True,
                                   dtype=torch.float32, device=device)

    def forward(self, x, t_emb, video_seg, audio_seg):
        shift, scale = self.adaln_proj(t_emb)

        def mod(seg):
            a, b, row = seg
            return (self.norm(x[a:b]) * (1.0 + scale[row]) + shift[row]).float()

        return self.video_out(mod(video_seg)), self.audio_out(mod(audio_seg))
