"""Every model file the bundled workflows load, under the official names, with random weights
small enough for a CPU: for running the workflows end to end on a real ComfyUI
(tests/test_workflows_e2e.py).

    python tests/e2e_models.py MODELS_DIR        # with COMFYUI_PATH set (ComfyUI importable)

- diffusion_models/minimax_h3_fl2va_pruned_int8_convrot, .../minimax_h3_ref2va_pruned_int8_convrot:
  a tiny DiT (2 + 2 blocks, 2 heads), INT8 ConvRot as published;
- text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq: a tiny Qwen3-VL (width 64, 50 layers, 3 vision
  blocks), bf16; it loads only with tests/comfyui_nodes/h3_tiny_text_encoder in the server (its
  docstring says why);
- vae/minimax_h3_video_vae_int8_convrot: the full-size video VAE (ComfyUI builds it at one size)
  with its decoder linears INT8 ConvRot: 2.8 GB, about 3.3 GB in CPU memory (the fp16 file
  would take 10 GB there as fp32);
- vae/minimax_h3_audio_vae_fp32: the full-size audio VAE, fp32;
- loras/ (both turbo LoRA names): rank-4 LoRAs on each block's four linears, ComfyUI's keys;
- latent_upscale_models/minimax_h3_latent_upscaler_3d_conv_v1_fp16: the community upscaler's
  layout at 32 channels, fp16.

Each file is written through ComfyUI's own classes on the meta device (tests/h3_checkpoints.py),
so its names and shapes are whatever the ComfyUI under test builds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
TINY_TE_NODE = TESTS / "comfyui_nodes" / "h3_tiny_text_encoder"
sys.path.insert(0, str(TESTS))

DIT_FILES = ("minimax_h3_fl2va_pruned_int8_convrot.safetensors",
             "minimax_h3_ref2va_pruned_int8_convrot.safetensors")
TEXT_ENCODER_FILE = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae_fp32.safetensors"
LORA_FILES = ("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
              "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors")
UPSCALER_FILE = "minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors"
LORA_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def tiny_text_encoder():
    """The test node's module (its sizes, and apply() for this process)."""
    spec = importlib.util.spec_from_file_location("h3_tiny_text_encoder",
                                                  TINY_TE_NODE / "__init__.py")
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def text_encoder_state_dict(seed: int = 5) -> dict[str, torch.Tensor]:
    """ComfyUI's MiniMax H3 Qwen3-VL at the tiny sizes, as the transformer's state dict (the
    names CLIPLoader's detection reads), bf16."""
    import comfy.ops
    import comfy.text_encoders.minimax as minimax
    from h3_checkpoints import _fill, _meta_state_dict

    tiny_text_encoder().apply()
    layout = _meta_state_dict(lambda: minimax.MiniMaxQwen3VL(
        {}, torch.bfloat16, "meta", comfy.ops.disable_weight_init))
    return _fill(layout, "bf16", seed, set(), torch.device("cpu"))


def lora_state_dict(dit_layout: dict[str, torch.Tensor], rank: int = 4, seed: int = 7
                    ) -> dict[str, torch.Tensor]:
    """A LoRA in ComfyUI's format (`diffusion_model.<module>.lora_up/lora_down.weight`,
    `.alpha`) on the four linears of every DiT block, bf16, small enough to keep the tiny
    model's outputs finite."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, meta in sorted(dit_layout.items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.startswith("blocks.")
                and module.endswith(LORA_TARGETS)):
            continue
        out_f, in_f = meta.shape
        key = f"diffusion_model.{module}"
        out[f"{key}.lora_down.weight"] = (torch.randn((rank, in_f), generator=gen)
                                          / in_f ** 0.5).to(torch.bfloat16)
        out[f"{key}.lora_up.weight"] = (0.05 * torch.randn((out_f, rank), generator=gen)
                                        / rank ** 0.5).to(torch.bfloat16)
        out[f"{key}.alpha"] = torch.tensor(float(rank))
    return out


def upscaler_state_dict(seed: int = 9) -> dict[str, torch.Tensor]:
    """The community latent upscaler's layout (h3_multigpu.upscale) at 32 channels, fp16."""
    from h3_multigpu.upscale import H3LatentUpscaler, UpscalerShape

    shape = UpscalerShape(channels=32, in_blocks=2, out_blocks=2)
    gen = torch.Generator().manual_seed(seed)
    net = H3LatentUpscaler(shape)
    return {f"upscaler.{k}": (torch.randn(v.shape, generator=gen) * 0.05).to(torch.float16)
            for k, v in net.state_dict().items()}


def audio_vae_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """h3_checkpoints' audio VAE with values its decoder keeps finite, so that the saved mp4
    gets an audio stream (FFmpeg's AAC encoder refuses NaN): anti-aliasing filters as
    normalised boxes, the encoder's Snake alphas at 1 (it divides by them); the shared writer
    already scales convolution weights by their whole fan-in."""
    import h3_checkpoints as ckpt

    sd = ckpt.audio_vae_state_dict(seed=seed)
    for name, value in sd.items():
        if name.endswith(".filter"):
            sd[name] = torch.full_like(value, 1.0 / value.shape[-1])
        elif name.endswith(".alpha") and value.ndim == 3:
            sd[name] = torch.ones_like(value)
    return sd


def write_models(models: Path) -> dict[str, Path]:
    """Write every file under `models/<folder>/`; return {file name: path}."""
    import h3_checkpoints as ckpt

    shape = ckpt.DiTShape.tiny(text_dim=tiny_text_encoder().TEXT_HIDDEN)
    written = {}
    for seed, name in enumerate(DIT_FILES):
        written[name] = ckpt.write_dit(models / "diffusion_models" / name, shape,
                                       "int8_convrot", seed=seed)
    written[TEXT_ENCODER_FILE] = ckpt._save(text_encoder_state_dict(),
                                            models / "text_encoders" / TEXT_ENCODER_FILE)
    layout = ckpt.dit_layout(shape)
    for seed, name in enumerate(LORA_FILES):
        written[name] = ckpt._save(lora_state_dict(layout, seed=7 + seed),
                                   models / "loras" / name)
    written[UPSCALER_FILE] = ckpt._save(upscaler_state_dict(),
                                        models / "latent_upscale_models" / UPSCALER_FILE)
    written[AUDIO_VAE_FILE] = ckpt._save(audio_vae_state_dict(), models / "vae" / AUDIO_VAE_FILE)
    written[VIDEO_VAE_FILE] = ckpt.write_video_vae(models / "vae" / VIDEO_VAE_FILE,
                                                   "int8_convrot")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, help="the models folder to fill")
    args = parser.parse_args()
    from comfyui_h3 import import_comfyui

    import_comfyui()  # $COMFYUI_PATH, on the CPU here
    written = write_models(args.models)
    print(json.dumps({name: path.stat().st_size for name, path in written.items()}))


if __name__ == "__main__":
    main()
