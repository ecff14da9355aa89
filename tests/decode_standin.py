"""A small stand-in for H3's video VAE decode, for CPU tests without ComfyUI.

Written from the facts of the decoder's structure (shared/H3 facts, issue 16), not from its
code: windows of 7 latent frames every 5, each decoded to 28 frames (a head of 17 after 3
dropped, a tail of 5 after 3 more dropped), tails cross-faded linearly into the next head over
5 frames, spatial tiles decoded a few per call and blended, float32 finalisation into a
preallocated output. Its `decode_temporal` is the plain one-device loop the split decode must
reproduce bit for bit; the real upstream class is tested in test_decode_comfyui.py.

`calls` (shared by a model and its decoding copies) lists which decoder module (by id) decoded
each window: the root's model and any view of it share one decoder, each copy has its own.
"""

from __future__ import annotations

import threading

import torch
from torch import nn


class _Decoder(nn.Module):
    """Tokens of one tile-window -> pixels: embed, one attention over all tokens, project."""

    def __init__(self, width: int, patch: int, frames_per_latent: int) -> None:
        super().__init__()
        self.patch, self.fpl = patch, frames_per_latent
        self.x_embedder = nn.Linear(24, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj_out = nn.Linear(width, 3 * frames_per_latent * patch * patch)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        b, _, t, h, w = x_BCTHW.shape
        tokens = self.x_embedder(x_BCTHW.flatten(2).transpose(1, 2))
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        tokens = tokens + torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = self.proj_out(tokens).view(b, t, h, w, 3, self.fpl, self.patch, self.patch)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, 3, t * self.fpl, h * self.patch, w * self.patch)


class StandInVideoVAE(nn.Module):
    tokens_chunk_size = 5
    token_overlap = 2
    vae_ratio_t = 4
    frame_pre_padding = 3
    frame_overlap = 5
    token_drop = 3

    def __init__(self, width: int = 16, patch: int = 2, tile: int = 3, tile_batch: int = 2,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        self.vae_ratio = patch
        self.tile, self.tile_batch = tile, tile_batch  # tile width in latent cells
        self.encoder = nn.Linear(4, 4)  # never used to decode: shared with decoding copies
        self.post_quant_conv = nn.Conv3d(24, 24, 1)
        self.decoder = _Decoder(width, patch, self.vae_ratio_t)
        self.register_buffer("pixel_mean", torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1, 1))
        self.register_buffer("pixel_std", torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1, 1))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.to(dtype)
        self.calls: list[int] = []  # id of the decoder that decoded each window
        self.call_threads: list[str] = []  # the thread each window was decoded on
        self.fail_copies_after: int | None = None  # a copy raises after this many windows
        self._origin = [self]

    # --- what the split decode calls -----------------------------------------------------

    def _decode_pixels(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))

    def split_tiles(self, cells: int) -> list[int]:
        """Tile starts along the width: tiles of `tile` cells overlapping by one cell."""
        if cells <= self.tile:
            return [0]
        starts = list(range(0, cells - self.tile, self.tile - 1))
        return starts + [cells - self.tile]

    def _decode_tile_row(self, z: torch.Tensor, starts: list[int]):
        width = min(self.tile, z.shape[-1])
        for k in range(0, len(starts), self.tile_batch):
            group = [z[..., s:s + width] for s in starts[k:k + self.tile_batch]]
            yield from self._decode_pixels(torch.cat(group)).chunk(len(group))

    def blend(self, a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
        extent = min(a.shape[dim], b.shape[dim], extent)
        ramp = torch.arange(extent, dtype=b.dtype, device=b.device) / extent
        shape = [1] * a.ndim
        shape[dim] = extent
        ramp = ramp.view(shape)
        mixed = a.narrow(dim, a.shape[dim] - extent, extent) * (1 - ramp) + \
            b.narrow(dim, 0, extent) * ramp
        return torch.cat([mixed, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)

    def tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        starts = self.split_tiles(z.shape[-1])
        p = self.vae_ratio
        out = None
        for s, tile in zip(starts, self._decode_tile_row(z, starts), strict=True):
            if out is None:
                out = tile
            else:  # overlap of (end of out - start of tile) pixels, blended
                overlap = out.shape[-1] - s * p
                out = torch.cat([out[..., :s * p], self.blend(out[..., s * p:], tile, overlap,
                                                               dim=-1)], dim=-1)
        return out

    def _adaptive_decode(self, z: torch.Tensor) -> torch.Tensor:
        origin = self._origin[0]
        mine = id(self.decoder)
        if mine != id(origin.decoder) and self.fail_copies_after is not None:
            if sum(1 for c in self.calls if c == mine) >= self.fail_copies_after:
                raise RuntimeError("simulated helper failure")
        self.calls.append(mine)
        self.call_threads.append(threading.current_thread().name)
        return self.tiled_decode(z)

    def _finalize_pixels(self, part: torch.Tensor) -> torch.Tensor:
        part = part * self.pixel_std.to(torch.float32)
        return part.add_(self.pixel_mean.to(torch.float32)).clamp_(0.0, 1.0)

    # --- the one-device decode ---------------------------------------------------------------

    def _decode_temporal_chunks(self, latent: int) -> tuple[int, int]:
        """(latent frames of padding, windows), as the upstream VAE names it."""
        total = latent + self.token_drop
        pad = (-total) % self.tokens_chunk_size
        count = (total + pad) // self.tokens_chunk_size - 1
        if count < 1:
            pad, count = pad + self.tokens_chunk_size, count + 1
        return pad, count

    def decode_output_shape(self, shape) -> tuple[int, ...]:
        b, _, t, h, w = shape
        pad, count = self._decode_temporal_chunks(t)
        frames = count * 17 + 5 - 4 * pad  # padding latents do not make frames
        return (b, 3, frames, h * self.vae_ratio, w * self.vae_ratio)

    def decode_temporal(self, z: torch.Tensor, output_buffer: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """Every window in order on this device: head (cross-faded with the previous tail),
        the last tail at the end, each part finalised and written at the next position."""
        out = output_buffer if output_buffer is not None else torch.empty(
            self.decode_output_shape(z.shape), dtype=torch.float32)
        pad, count = self._decode_temporal_chunks(z.shape[2])
        if pad:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        pos, pending = 0, None
        for i in range(count):
            frames = self._adaptive_decode(z[:, :, 5 * i:5 * i + 7])
            head, tail = frames[:, :, 3:20], frames[:, :, 23:28]
            if pending is not None:
                head = self.blend(pending, head, self.frame_overlap, dim=-3)
            parts = [head, tail] if i == count - 1 else [head]
            pending = tail
            for part in parts:
                n = min(part.shape[2], out.shape[2] - pos)
                if n > 0:
                    out[:, :, pos:pos + n].copy_(self._finalize_pixels(part)[:, :, :n])
                pos += part.shape[2]
        return out


class FakePatcher:
    """ComfyUI's ModelPatcher surface a VAE patch uses: clone(), object patches and the
    model_options the seam records its installs in."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.object_patches: dict = {}
        self.model_options: dict = {}

    def clone(self) -> FakePatcher:
        n = FakePatcher(self.model)
        n.object_patches = dict(self.object_patches)
        n.model_options = {k: dict(v) if isinstance(v, dict) else v
                           for k, v in self.model_options.items()}
        return n

    def add_object_patch(self, name: str, obj) -> None:
        self.object_patches[name] = obj


class FakeVAE:
    """ComfyUI's VAE.decode envelope for a chunked-io video VAE, in miniature: object patches
    applied while the model runs, one preallocated float32 output, channels last."""

    def __init__(self, model: nn.Module, device: str = "cpu") -> None:
        self.first_stage_model = model
        self.patcher = FakePatcher(model)
        self.device = torch.device(device)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        model = self.first_stage_model
        out = torch.empty(model.decode_output_shape(latent.shape), dtype=torch.float32)
        saved = {k: model.__dict__.get(k) for k in self.patcher.object_patches}
        for name, obj in self.patcher.object_patches.items():
            setattr(model, name, obj)
        try:
            z = latent.to(next(model.decoder.parameters()).dtype)
            model.decode_temporal(z, out)
        finally:
            for name, old in saved.items():
                if old is None:
                    delattr(model, name)
                else:
                    setattr(model, name, old)
        return out.movedim(1, -1)
