"""The twin's layers: attention, MLP, AdaLN projections, DiT / refiner blocks, output heads.

Module and parameter names are upstream's (`comfy/ldm/minimax/model.py`), so state-dict keys,
LoRA keys and object patches (`blocks.7.attn.qkv_proj`, `token_refiner.blocks.0.mlp.fc1`,
`blocks.3.forward`, ...) target the same names on both. Layers come from `operations` (ComfyUI's
`comfy.ops.*` classes, or plain `torch.nn` by default). Each block computes what upstream's block
computes, op for op: in-place q/k RMSNorm + split-half RoPE on the qkv buffer, strided
`[1, H, S, D]` container views into `optimized_attention` with the module's preferred
attention, per-segment AdaLN modulation and in-place gated residuals.

The pack's chunking and sequence modes run this block's own forward (as they run upstream's)
and change only on which rows its modules run; the old runner kept for timing in `dev/bench/`
(`dev/bench/legacy_h3_ops.py`) looks up `optimized_attention`, `AttentionTensorContainer`,
`rms_rope_split_half_`, `mod_scale_shift` and `mod_gate` on this module, as on ComfyUI's.

Legend: S tokens of the packed sequence, C hidden width, H heads, D head dim, M timesteps.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionTensorContainer, ComfyAttention, optimized_attention
from .config import TwinConfig
from .rope import rms_rope_split_half_

__all__ = ["AttentionTensorContainer", "optimized_attention", "rms_rope_split_half_"]

TORCH_OPERATIONS = SimpleNamespace(Linear=nn.Linear, RMSNorm=nn.RMSNorm)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """gate = first half of fc1's rows, up = second half: silu(gate) * up."""
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def modulation_vectors(vectors: torch.Tensor, row: Any, dtype: torch.dtype) -> torch.Tensor:
    """One modulation row (an int), or one per token (a LongTensor of rows), in `dtype`."""
    return vectors[row].to(dtype)


def mod_scale_shift(h: torch.Tensor, shift, scale, segments) -> torch.Tensor:
    """h[a:b] = h[a:b] * (1 + scale[row]) + shift[row], in place, per (a, b, row) segment."""
    for a, b, row in segments:
        h[a:b].mul_(1.0 + modulation_vectors(scale, row, h.dtype))
        h[a:b].add_(modulation_vectors(shift, row, h.dtype))
    return h


def mod_gate(x: torch.Tensor, gate, branch: torch.Tensor, segments) -> torch.Tensor:
    """x[a:b] += branch[a:b] * gate[row], in place (one fused kernel per segment)."""
    for a, b, row in segments:
        x[a:b].addcmul_(branch[a:b], modulation_vectors(gate, row, x.dtype))
    return x


def _layers(operations):
    return TORCH_OPERATIONS if operations is None else operations


class Attention(nn.Module):
    def __init__(self, cfg: TwinConfig, gate_compress: bool = False, dtype=None, device=None,
                 operations=None):
        super().__init__()
        ops = _layers(operations)
        self.comfy_attention = ComfyAttention()
        self.heads = cfg.heads
        self.head_dim = cfg.head_dim
        self.qkv_proj = ops.Linear(cfg.hidden, cfg.inner * 3, bias=False, dtype=dtype,
                                   device=device)
        self.q_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.qk_eps, dtype=dtype, device=device)
        self.k_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.qk_eps, dtype=dtype, device=device)
        self.out_proj = ops.Linear(cfg.inner, cfg.hidden, bias=False, dtype=dtype, device=device)
        self.to_gate_compress = None
        if gate_compress:  # read by sparse-attention patches only
            self.to_gate_compress = ops.Linear(cfg.hidden, cfg.inner, bias=False, dtype=dtype,
                                               device=device)

    def forward(self, x_SC: torch.Tensor, rope_freqs: torch.Tensor | None = None,
                transformer_options: dict | None = None) -> torch.Tensor:
        transformer_options = {} if transformer_options is None else transformer_options
        s, heads, dim = x_SC.shape[0], self.heads, self.head_dim
        q, k, v = self.qkv_proj(x_SC).split(heads * dim, dim=-1)
        v_SHD = v.view(s, heads, dim)
        if rope_freqs is None:  # the token refiner: plain per-head norms, no rotation
            q_SHD = self.q_norm(q.view(s, heads, dim))
            k_SHD = self.k_norm(k.view(s, heads, dim))
        else:
            q_BSHD, k_BSHD = q.view(1, s, heads, dim), k.view(1, s, heads, dim)
            rms_rope_split_half_(q_BSHD, k_BSHD, rope_freqs, self.q_norm.weight.to(x_SC.device),
                                 self.k_norm.weight.to(x_SC.device), self.q_norm.eps,
                                 rope_freqs.shape[-3] * 2)
            q_SHD, k_SHD = q_BSHD[0], k_BSHD[0]
        q_c, k_c, v_c = (AttentionTensorContainer(t.transpose(0, 1).unsqueeze(0))
                         for t in (q_SHD, k_SHD, v_SHD))
        out_BSI = optimized_attention(q_c, k_c, v_c, heads,
                                      preferred_attention=self.comfy_attention, mask=None,
                                      skip_reshape=True, transformer_options=transformer_options)
        return self.out_proj(out_BSI.squeeze(0))


class MLP(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None, operations=None):
        super().__init__()
        ops = _layers(operations)
        self.fc1 = ops.Linear(cfg.hidden, cfg.ffn * 2, bias=False, dtype=dtype, device=device)
        self.fc2 = ops.Linear(cfg.ffn, cfg.hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x_SC: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x_SC)))


class AdalnProj(nn.Module):
    """[M, t_dim] time embedding -> `expand` tensors of [M * modalities, C].

    Row m * modalities + tag of each tensor modulates tokens of timestep m and modality `tag`.
    """

    def __init__(self, cfg: TwinConfig, expand: int, modalities: int, dtype=None, device=None,
                 operations=None):
        super().__init__()
        self.expand, self.modalities, self.hidden = expand, modalities, cfg.hidden
        self.apply_silu = not cfg.pruned_adaln  # pruned tables are already post-activation
        self.linear = _layers(operations).Linear(cfg.t_dim, expand * cfg.hidden * modalities,
                                                 bias=True, dtype=dtype, device=device)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.linear(F.silu(t_emb) if self.apply_silu else t_emb)
        return y.view(y.shape[0] * self.modalities, self.expand * self.hidden).chunk(self.expand,
                                                                                     dim=-1)


def _adaln_dtype(cfg: TwinConfig, dtype):
    return torch.float32 if cfg.pruned_adaln else dtype


class DiTBlock(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None, operations=None):
        super().__init__()
        ops = _layers(operations)
        self.norm1 = ops.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.norm2 = ops.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, gate_compress=cfg.gate_compress, dtype=dtype, device=device,
                              operations=operations)
        self.mlp = MLP(cfg, dtype=dtype, device=device, operations=operations)
        self.adaln_proj = AdalnProj(cfg, 6, 3, dtype=_adaln_dtype(cfg, dtype), device=device,
                                    operations=operations)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None,
                attention=None):
        transformer_options = {} if transformer_options is None else transformer_options
        attention = self.attn if attention is None else attention
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
        h = mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
        attn_out = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        x = mod_gate(x, gate_msa, attn_out, mod_segments)
        h = mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)
        return mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


class RefinerBlock(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None, operations=None):
        super().__init__()
        ops = _layers(operations)
        self.norm1 = ops.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.norm2 = ops.RMSNorm(cfg.hidden, eps=cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype=dtype, device=device, operations=operations)
        self.mlp = MLP(cfg, dtype=dtype, device=device, operations=operations)

    def forward(self, x, transformer_options=None):
        x = self.attn(self.norm1(x), transformer_options=transformer_options).add_(x)
        return self.mlp(self.norm2(x)).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None, operations=None):
        super().__init__()
        self.blocks = nn.ModuleList([RefinerBlock(cfg, dtype=dtype, device=device,
                                                  operations=operations)
                                     for _ in range(cfg.refiner_blocks)])
        self.final_norm = _layers(operations).RMSNorm(cfg.hidden, eps=cfg.final_eps, dtype=dtype,
                                                      device=device)

    def forward(self, x, transformer_options=None):
        for block in self.blocks:
            x = block(x, transformer_options=transformer_options)
        return self.final_norm(x)


class TimeEmbedder(nn.Module):
    """Full-AdaLN time embedding: [M] timesteps in [0, 1] -> [M, t_dim], fp32 throughout."""

    def __init__(self, cfg: TwinConfig, device=None, operations=None):
        super().__init__()
        ops = _layers(operations)
        width = cfg.time_embed_hidden or cfg.hidden
        self.freq_dim = cfg.timestep_freq_dim
        self.proj_in = ops.Linear(self.freq_dim, width, bias=True, dtype=torch.float32,
                                  device=device)
        self.proj_out = ops.Linear(width, cfg.t_dim, bias=True, dtype=torch.float32,
                                   device=device)

    def forward(self, t_M: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        steps = torch.arange(half, dtype=torch.float32, device=t_M.device)
        freqs = torch.exp(-math.log(10000.0) * steps / half)
        angles = t_M.to(torch.float32)[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)  # cos first
        return self.proj_out(F.silu(self.proj_in(features)))


class FinalLayer(nn.Module):
    def __init__(self, cfg: TwinConfig, dtype=None, device=None, operations=None):
        super().__init__()
        ops = _layers(operations)
        self.norm = ops.RMSNorm(cfg.hidden, eps=cfg.final_eps, dtype=dtype, device=device)
        self.adaln_proj = AdalnProj(cfg, 2, 1, dtype=_adaln_dtype(cfg, dtype), device=device,
                                    operations=operations)
        # the output heads stay fp32 whatever the model dtype
        self.video_out = ops.Linear(cfg.hidden, cfg.latents_dim * 4, bias=True,
                                    dtype=torch.float32, device=device)
        self.audio_out = ops.Linear(cfg.hidden, cfg.audio_latents_dim, bias=True,
                                    dtype=torch.float32, device=device)

    def forward(self, x, t_emb, video_seg, audio_seg):
        """Rows of the target streams -> (video patches [Sv, 4c] fp32, audio rows [Sa, c] fp32).

        `video_seg` / `audio_seg` are (start, stop, row) with row a timestep index (one per
        segment, or a LongTensor per token).
        """
        shift, scale = self.adaln_proj(t_emb)

        def modulated(segment):
            a, b, row = segment
            normed = self.norm(x[a:b])
            return (normed * (1.0 + modulation_vectors(scale, row, scale.dtype))
                    + modulation_vectors(shift, row, shift.dtype)).to(torch.float32)

        return self.video_out(modulated(video_seg)), self.audio_out(modulated(audio_seg))
