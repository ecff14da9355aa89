"""The MiniMax H3 learned latent upscaler (the community "3D conv v1" checkpoint), in PyTorch.

Shapes: latents are `x_BCTHW` (batch, 24 channels, latent frames, latent height, latent width).

The module tree mirrors the checkpoint's state-dict names (optionally prefixed `upscaler.`), so
the file loads strictly:

    conv_in                 Conv3d 24 -> C, 3x3x3
    embed.0, embed.2        Linear 1 -> 64, SiLU, Linear 64 -> 64: embedding of (scale - 1)
    in_blocks.<i>           residual blocks; after every `temporal_every`-th one (0, 2, 4, ...)
                            a temporal block
    (one trilinear resize of the features to the exact target frames x height x width)
    out_blocks.<i>          the same again
    norm_out, conv_out      GroupNorm(32, C), SiLU, Conv3d C -> 24, 3x3x3

Residual block (`in_layers`, `emb_layers`, `out_norm`, `out_layers`):
    h = conv(silu(norm(x)));  scale, shift = linear(silu(emb)).chunk(2)
    h = norm(h) * (1 + scale) + shift;  x + conv(silu(h))
Temporal block (`norm`, `dwconv`, `pwconv`): x + pointwise(depthwise_k_over_time(silu(norm(x)))).

The network works on latents normalised once more by the H3 video VAE's per-channel mean and
std (`LATENT_MEAN`, `LATENT_STD`); `upscale/run.py` applies and undoes that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..comfy_seam.interrupts import raise_if_interrupted as check_interrupt

# The H3 video VAE's per-channel latent statistics the checkpoint was trained with.
LATENT_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)
LATENT_STD = (
    1.2223774194717407, 1.2767263650894165, 1.6831774711608887, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.9653137922286987, 1.0569885969161987,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946881835975647,
    0.7996809482574463, 0.44988900423049927, 0.7197399735450745, 0.6936293244361877,
    2.961095094680786, 2.7694199085235596, 3.0496184825897217, 2.1088054180145264,
    3.276226282119751, 3.1627357006073, 2.2816812992095947, 2.6127843856811523,
)
EMBED_DIM = 64
GROUPS = 32
KEY_PREFIX = "upscaler."


@dataclass(frozen=True)
class UpscalerShape:
    """The sizes a checkpoint describes (v1: 24 / 512 / 12 / 12 / every 2 / kernel 5)."""

    latent_channels: int = 24
    channels: int = 512
    in_blocks: int = 12
    out_blocks: int = 12
    temporal_every: int = 2
    temporal_kernel: int = 5

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> UpscalerShape:
        """Read the sizes from tensor shapes; ValueError when `sd` is not this network."""
        conv_in = sd.get("conv_in.weight")
        if conv_in is None or conv_in.ndim != 5 or "conv_out.weight" not in sd:
            raise ValueError("not an H3 latent upscaler checkpoint (no 3D conv_in/conv_out); "
                             "use minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors")
        counts = {}
        for part in ("in", "out"):
            pattern = re.compile(rf"{part}_blocks\.(\d+)\.in_layers\.")
            counts[part] = len({m.group(1) for k in sd if (m := pattern.match(k))})
        dwconv = next((v for k, v in sd.items() if k.endswith(".dwconv.weight")), None)
        return cls(latent_channels=int(conv_in.shape[1]), channels=int(conv_in.shape[0]),
                   in_blocks=counts["in"], out_blocks=counts["out"],
                   temporal_every=2 if dwconv is not None else 0,
                   temporal_kernel=int(dwconv.shape[2]) if dwconv is not None else 5)


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(GROUPS, channels), nn.SiLU(),
                                       nn.Conv3d(channels, channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(EMBED_DIM, 2 * channels))
        self.out_norm = nn.GroupNorm(GROUPS, channels)
        self.out_layers = nn.Sequential(nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv3d(channels, channels, 3, padding=1))

    def forward(self, x_BCTHW: torch.Tensor, emb_BE: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x_BCTHW)
        scale_BC, shift_BC = self.emb_layers(emb_BE).to(h.dtype).chunk(2, dim=1)
        h = self.out_norm(h) * (1 + scale_BC[:, :, None, None, None]) \
            + shift_BC[:, :, None, None, None]
        return x_BCTHW + self.out_layers(h)


class TemporalBlock(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.norm = nn.GroupNorm(GROUPS, channels)
        self.dwconv = nn.Conv3d(channels, channels, (kernel, 1, 1), padding=(kernel // 2, 0, 0),
                                groups=channels)
        self.pwconv = nn.Conv3d(channels, channels, 1)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        return x_BCTHW + self.pwconv(self.dwconv(F.silu(self.norm(x_BCTHW))))


def _stage(shape: UpscalerShape, blocks: int) -> nn.ModuleList:
    stage = nn.ModuleList()
    for index in range(blocks):
        stage.append(ResidualBlock(shape.channels))
        if shape.temporal_every and index % shape.temporal_every == 0:
            stage.append(TemporalBlock(shape.channels, shape.temporal_kernel))
    return stage


class H3LatentUpscaler(nn.Module):
    """Normalised H3 video latent -> the same latent at (frames, height, width)."""

    def __init__(self, shape: UpscalerShape = UpscalerShape()):
        super().__init__()
        self.shape = shape
        c = shape.channels
        self.conv_in = nn.Conv3d(shape.latent_channels, c, 3, padding=1)
        self.embed = nn.Sequential(nn.Linear(1, EMBED_DIM), nn.SiLU(),
                                   nn.Linear(EMBED_DIM, EMBED_DIM))
        self.in_blocks = _stage(shape, shape.in_blocks)
        self.out_blocks = _stage(shape, shape.out_blocks)
        self.norm_out = nn.GroupNorm(GROUPS, c)
        self.conv_out = nn.Conv3d(c, shape.latent_channels, 3, padding=1)

    @staticmethod
    def _run(stage: nn.ModuleList, z: torch.Tensor, emb_BE: torch.Tensor) -> torch.Tensor:
        for block in stage:
            # plain torch layers check no cancel: ComfyUI's is seen between blocks
            check_interrupt()
            z = block(z, emb_BE) if isinstance(block, ResidualBlock) else block(z)
        return z

    def forward(self, x_BCTHW: torch.Tensor, scale: float,
                size_THW: tuple[int, int, int]) -> torch.Tensor:
        """`scale`: the mean of the height and width ratios (the embedding sees scale - 1)."""
        step = torch.tensor([[scale - 1.0]], dtype=x_BCTHW.dtype, device=x_BCTHW.device)
        emb_BE = self.embed(step).expand(x_BCTHW.shape[0], -1)
        z = self._run(self.in_blocks, self.conv_in(x_BCTHW), emb_BE)
        z = F.interpolate(z, size=tuple(size_THW), mode="trilinear", align_corners=False)
        z = self._run(self.out_blocks, z, emb_BE)
        return self.conv_out(F.silu(self.norm_out(z)))


def strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints saved from a wrapper carry an `upscaler.` prefix; drop it."""
    if any(k.startswith(KEY_PREFIX) for k in sd):
        return {k[len(KEY_PREFIX):]: v for k, v in sd.items() if k.startswith(KEY_PREFIX)}
    return dict(sd)


def build_from_state_dict(sd: dict[str, torch.Tensor]) -> H3LatentUpscaler:
    """The network a state dict describes, its tensors loaded strictly (eval mode)."""
    sd = strip_prefix(sd)
    net = H3LatentUpscaler(UpscalerShape.from_state_dict(sd))
    missing, unexpected = net.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not match the H3 latent upscaler: missing "
                         f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}; use "
                         f"minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors")
    return net.eval().requires_grad_(False)
