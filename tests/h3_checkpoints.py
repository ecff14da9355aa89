"""Random-weight H3 checkpoints in the official file formats, for ComfyUI's own loaders.

    path = write_dit(tmp / "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                     DiTShape.tiny(), "int8_convrot", seed=0)
    patcher = comfy.sd.load_diffusion_model(str(path))      # what UNETLoader does

The tensor names, shapes and storage dtypes come from the ComfyUI in this process: its
`MiniMaxH3Model` (or VAE class) is built on the meta device and its `state_dict()` read, so a
file matches whatever release is under test. Values are seeded random numbers of a sensible
scale. Formats, as the official files store them:

- `int8_convrot` (`minimax_h3_fl2va_pruned_int8_convrot`): the four linears of each of the 50
  DiT blocks (not the token refiner) as ComfyUI's `int8_tensorwise` layer format: an int8
  `weight`, a float32 per-output-channel `weight_scale` [out, 1] and a `comfy_quant` JSON
  (`{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}`) that
  `ops.mixed_precision_ops` reads. Everything else bf16, with the model's fp32 islands (patch
  projections, output heads, rope, the AdaLN curve table and projections). The official file has
  932 tensors: `DiTShape.full()` written this way has the same count.
- `bf16`, `fp16`, `fp32`: every weight in that dtype, the fp32 islands kept.

Random int8 weights are drawn as the quantisation of a Gaussian (round(w / scale), scale =
max|w| / 127 per output channel). ConvRot's rotation of the stored weight is not applied: a
rotated Gaussian is a Gaussian, and the loader and kernels only read the flag.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

FORMATS = ("int8_convrot", "bf16", "fp16", "fp32")
CONVROT_GROUPSIZE = 256
QUANTIZED_BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
OFFICIAL_INT8_DIT_TENSORS = 932  # the published file's header (50 blocks, 200 INT8 linears)


@dataclass(frozen=True)
class DiTShape:
    """The dimensions ComfyUI's H3 detection reads from a DiT state dict."""

    hidden: int = 5376
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336
    blocks: int = 50
    refiner_blocks: int = 2
    text_dim: int = 5120
    time_embed_dim: int = 8          # the curve width of the pruned form
    curve_grid: int | None = 1025    # None: the full AdaLN form with a time embedder
    time_embed_hidden: int = 5376    # full form only
    timestep_input_dim: int = 256    # full form only
    rope_inv_freq_len: int = 16

    @classmethod
    def full(cls) -> DiTShape:
        return cls()

    @classmethod
    def tiny(cls, **overrides: Any) -> DiTShape:
        """Two 128-dim heads (H3's head size and rope split), widths that are multiples of the
        ConvRot group (256), 2 + 2 blocks."""
        base = cls(hidden=256, heads=2, ffn=512, blocks=2, refiner_blocks=2, text_dim=64,
                   time_embed_dim=8, curve_grid=33, time_embed_hidden=256)
        return replace(base, **overrides)

    def model_kwargs(self) -> dict[str, Any]:
        """Constructor arguments of ComfyUI's MiniMaxH3Model for this shape."""
        kwargs = dict(hidden_size=self.hidden, num_layers=self.blocks,
                      token_refiner_num_layers=self.refiner_blocks,
                      num_attention_heads=self.heads, attention_head_dim=self.head_dim,
                      ffn_hidden_size=self.ffn, text_dim=self.text_dim,
                      time_embed_dim=self.time_embed_dim,
                      rope_inv_freq_len=self.rope_inv_freq_len)
        if self.curve_grid is not None:
            kwargs["adaln_curve_grid"] = self.curve_grid
        else:
            kwargs.update(timestep_input_dim=self.timestep_input_dim,
                          time_embed_hidden_size=self.time_embed_hidden)
        return kwargs


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def _meta_state_dict(module_factory) -> dict[str, torch.Tensor]:
    """The module's state dict as meta tensors. Built with DynamicVRAM's lazy layers off:
    under comfy-aimdo ComfyUI's Linear creates no weight until a state dict is loaded."""
    import comfy.memory_management as memory

    lazy, memory.aimdo_enabled = memory.aimdo_enabled, False
    try:
        with torch.device("meta"):
            module = module_factory()
    finally:
        memory.aimdo_enabled = lazy
    return dict(module.state_dict())


def dit_layout(shape: DiTShape) -> dict[str, torch.Tensor]:
    """name -> meta tensor (shape, dtype as ComfyUI declares it at bf16) of ComfyUI's H3 DiT."""
    import comfy.ldm.minimax.model as h3
    import comfy.ops

    return _meta_state_dict(lambda: h3.MiniMaxH3Model(
        **shape.model_kwargs(), dtype=torch.bfloat16, device="meta",
        operations=comfy.ops.disable_weight_init))


def _random_value(name: str, shape: tuple[int, ...], gen: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """Seeded fp32 values of a sensible scale for one tensor, by what the name says it is."""
    if name.endswith("inv_freq"):
        return 1.0 / (10000.0 ** (torch.arange(shape[0], dtype=torch.float32, device=device)
                                  / shape[0]))
    randn = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    if "norm" in name and name.endswith("weight"):
        return randn.mul_(0.1).add_(1.0)
    if name.endswith("bias"):
        return randn.mul_(0.02)
    if name.endswith("adaln_t_table"):
        return randn.mul_(0.5)
    if len(shape) >= 2:  # linear [out, in] or convolution [out, in, *kernel]: 1/sqrt(fan-in)
        return randn.div_(math.prod(shape[1:]) ** 0.5)
    return randn.mul_(0.1)


def int8_weight(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as int8 qdata and a float32 per-output-channel scale [out, 1]."""
    scale = w_NK.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8).div_(127.0)
    q = torch.round(w_NK / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def comfy_quant_tensor(conf: dict[str, Any]) -> torch.Tensor:
    """A layer's `comfy_quant` entry: its JSON as a uint8 tensor, as ComfyUI writes it."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


INT8_CONVROT_CONF = {"format": "int8_tensorwise", "convrot": True,
                     "convrot_groupsize": CONVROT_GROUPSIZE}


def _fill(layout: dict[str, torch.Tensor], fmt: str, seed: int, quantized: set[str],
          device: torch.device) -> dict[str, torch.Tensor]:
    storage = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
               "int8_convrot": torch.bfloat16}[fmt]
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(layout):
        meta = layout[name]
        value = _random_value(name, tuple(meta.shape), gen, device)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in quantized:
            q, scale = int8_weight(value)
            out[name] = q.cpu()
            out[f"{module}.weight_scale"] = scale.cpu()
            out[f"{module}.comfy_quant"] = comfy_quant_tensor(INT8_CONVROT_CONF)
            continue
        # fp32 islands stay fp32; everything stored at model dtype takes the file's dtype
        dtype = torch.float32 if meta.dtype == torch.float32 else storage
        out[name] = value.to(dtype).cpu()
        del value
    return out


def dit_state_dict(shape: DiTShape, fmt: str, *, seed: int = 0,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A DiT file's tensors in `fmt` (see the module docstring). `device` is where the random
    numbers are drawn (a GPU draws a full-size file in seconds); the result is on the CPU."""
    _check_format(fmt)
    layout = dit_layout(shape)
    quantized: set[str] = set()
    if fmt == "int8_convrot":
        quantized = {f"blocks.{i}.{lin}" for i in range(shape.blocks)
                     for lin in QUANTIZED_BLOCK_LINEARS}
    return _fill(layout, fmt, seed, quantized, torch.device(device))


def _save(sd: dict[str, torch.Tensor], path: str | os.PathLike,
          metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(sd, str(tmp), metadata=metadata)
    os.replace(tmp, path)  # never leave a half-written file under the official name
    return path


def write_dit(path: str | os.PathLike, shape: DiTShape, fmt: str, *, seed: int = 0,
              device: str | torch.device = "cpu") -> Path:
    """Write a DiT checkpoint; the metadata records how it was made (not read by ComfyUI)."""
    sd = dit_state_dict(shape, fmt, seed=seed, device=device)
    made = json.dumps({"format": fmt, "seed": seed, "shape": asdict(shape)})
    return _save(sd, path, metadata={"h3_multigpu_random_checkpoint": made})


# ---------------------------------------------------------------------------------------------
# VAEs (ComfyUI builds them at one fixed size, so there is no tiny form)
# ---------------------------------------------------------------------------------------------

def video_vae_layout() -> dict[str, torch.Tensor]:
    import comfy.ldm.minimax.vae as h3_vae
    import comfy.ops

    return _meta_state_dict(lambda: h3_vae.MiniMaxH3VideoVAE(
        operations=comfy.ops.disable_weight_init))


def video_vae_linears() -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of the video VAE's decoder Linear layers (what an INT8 file
    quantizes: ComfyUI's mixed-precision ops take Linear layers only)."""
    import comfy.ldm.minimax.vae as h3_vae
    import comfy.ops

    with torch.device("meta"):
        model = h3_vae.MiniMaxH3VideoVAE(operations=comfy.ops.disable_weight_init)
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.startswith("decoder.")
            and m.in_features % CONVROT_GROUPSIZE == 0}


def video_vae_state_dict(fmt: str = "fp16", *, seed: int = 0,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The video VAE file: `fp16` (minimax_h3_video_vae_fp16) or `int8_convrot` (the decoder's
    Linear layers INT8 ConvRot, the rest fp16: minimax_h3_video_vae_int8_convrot)."""
    if fmt not in ("fp16", "int8_convrot", "bf16", "fp32"):
        raise ValueError(f"video VAE format {fmt!r}: use fp16, int8_convrot, bf16 or fp32")
    layout = video_vae_layout()
    quantized = set(video_vae_linears()) if fmt == "int8_convrot" else set()
    storage = "fp16" if fmt == "int8_convrot" else fmt
    # the VAE declares no fp32 islands: every float tensor takes the file's dtype
    layout = {k: v.to(torch.float16) if v.dtype.is_floating_point else v
              for k, v in layout.items()}
    sd = _fill(layout, "int8_convrot" if quantized else storage, seed, quantized,
               torch.device(device))
    if quantized:
        sd = {k: v.to(torch.float16) if v.dtype == torch.bfloat16 else v for k, v in sd.items()}
    return sd


def write_video_vae(path: str | os.PathLike, fmt: str = "fp16", *, seed: int = 0,
                    device: str | torch.device = "cpu") -> Path:
    return _save(video_vae_state_dict(fmt, seed=seed, device=device), path)


def audio_vae_state_dict(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """The audio VAE file (minimax_h3_audio_vae_fp32): every tensor float32."""
    import comfy.ldm.minimax.audio_vae as h3_audio

    layout = _meta_state_dict(lambda: h3_audio.MiniMaxH3AudioVAE())
    layout = {k: v.to(torch.float32) if v.dtype.is_floating_point else v
              for k, v in layout.items()}
    return _fill(layout, "fp32", seed, set(), torch.device("cpu"))


def write_audio_vae(path: str | os.PathLike, *, seed: int = 0) -> Path:
    return _save(audio_vae_state_dict(seed=seed), path)
