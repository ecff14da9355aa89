"""Placeholder model files and input images for running the bundled workflows on a real ComfyUI.

The server needs every file a workflow names to exist (its loaders' lists and LoadImage's
check come from the folders), not to be valid: with these placeholders a prompt validates
completely and fails only when a loader reads the weights.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
# loader class -> (input naming the file, models folder)
LOADERS = {
    "UNETLoader": ("unet_name", "diffusion_models"),
    "CLIPLoader": ("clip_name", "text_encoders"),
    "VAELoader": ("vae_name", "vae"),
    "LoraLoaderModelOnly": ("lora_name", "loras"),
    "LatentUpscaleModelLoader": ("model_name", "latent_upscale_models"),
    "H3MultiGPULatentUpscalerLoader": ("upscaler_name", "latent_upscale_models"),
}
PLACEHOLDER = b"placeholder: not a model file\n"


def tiny_png(width: int = 64, height: int = 48) -> bytes:
    """A valid RGB PNG (LoadImage opens it when the graph runs)."""
    row = b"\x00" + bytes([200, 120, 40]) * width
    raw = row * height

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def needed_files(api_paths) -> dict[str, set[str]]:
    """models folder -> file names the API workflows load; "input" -> images."""
    files: dict[str, set[str]] = {}
    for path in api_paths:
        for node in json.loads(Path(path).read_text()).values():
            kind, inputs = node["class_type"], node["inputs"]
            if kind in LOADERS:
                key, folder = LOADERS[kind]
                files.setdefault(folder, set()).add(inputs[key])
            if kind == "LoadImage":
                files.setdefault("input", set()).add(inputs["image"])
    return files


def make_bed(root: Path, api_paths=None) -> tuple[str, ...]:
    """Write placeholders under `root`; return the extra ComfyUI arguments that use them."""
    api_paths = api_paths or sorted((WORKFLOWS / "api").glob("*.json"))
    models = root / "models"
    inputs = root / "input"
    inputs.mkdir(parents=True, exist_ok=True)
    folders = []
    for folder, names in needed_files(api_paths).items():
        for name in names:
            target = (inputs if folder == "input" else models / folder) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tiny_png() if folder == "input" else PLACEHOLDER)
        if folder != "input":
            folders.append(folder)
    config = root / "extra_model_paths.yaml"
    lines = ["h3_placeholders:", f"  base_path: {models}"]
    lines += [f"  {folder}: {folder}" for folder in sorted(set(folders))]
    config.write_text("\n".join(lines) + "\n")
    return ("--extra-model-paths-config", str(config), "--input-directory", str(inputs))
