"""Corrupt and foreign checkpoints, refused by file name before any weight is read.

Pure Python (no torch, no ComfyUI): a safetensors file is an 8-byte little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` and the tensors'
bytes, so everything here reads the header and, for quantized layers, their few-byte
`comfy_quant` JSON tensors; never the weights.

What ComfyUI's own loader says (0.33.0 and the newest files, `comfy.utils.load_torch_file`,
`comfy.ops` mixed-precision loading) and what is said here instead, naming the file:
- a truncated download: "SafetensorsError: incomplete metadata, file not fully covered" ->
  how many bytes the header lists and how many the file has;
- a layer's `comfy_quant` that is not JSON, not an object, without `format`, with a format
  ComfyUI does not know, or a `convrot_groupsize` that is not a number: a JSONDecodeError,
  "KeyError: 'int9'", "'list' object has no attribute 'get'", "invalid literal for int()" ->
  the layer, what it holds and what it should;
- a layer whose format does not match how its weight is stored (INT8 data labelled fp8):
  ComfyUI loads it and computes garbage -> refused;
- a file that is not an H3 DiT (a LoRA, a VAE, another model's DiT): said what it looks like.

Callers: `nodes/model_check.py` (the H3 Multi-GPU node, for the file its MODEL was loaded from),
the latent upscaler loader (before ComfyUI reads the file), and the planner's `--dit-file`
(`check_dit_file` before it reads block sizes).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_QUANT_CONF_BYTES = 1 << 16  # a layer's comfy_quant JSON is about 80 bytes
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8}  # sub-byte types (F4, F6_*) are not size-checked

# The quantization formats of ComfyUI 0.33.0 and the newest files (`comfy.quant_ops.
# QUANT_ALGOS`): how the weight is stored on disk (fp8 may also be stored as U8 bytes, which
# ComfyUI views as fp8) and the scales its loader requires. Reference data; inside ComfyUI the
# caller passes the registry of the running release instead (`model_check.comfy_formats`).
FORMATS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "float8_e4m3fn": (frozenset({"F8_E4M3", "U8"}), frozenset()),
    "float8_e5m2": (frozenset({"F8_E5M2", "U8"}), frozenset()),
    "mxfp8": (frozenset({"F8_E4M3", "U8"}), frozenset({"weight_scale"})),
    "nvfp4": (frozenset({"U8"}), frozenset({"weight_scale", "weight_scale_2"})),
    "int8_tensorwise": (frozenset({"I8"}), frozenset({"weight_scale"})),
    "convrot_w4a4": (frozenset({"I8"}), frozenset({"weight_scale"})),
    "asym_w4a8_int8": (frozenset({"I8"}), frozenset({"weight_scale"})),
}
H3_DIT_FILE = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
FIX_DOWNLOAD = "download it again (its size must match the one on the model page)"

# What a file that is not an H3 DiT looks like, by its tensor names (first match wins)
LOOKS_LIKE: tuple[tuple[tuple[str, ...], str], ...] = (
    ((".lora_A.", ".lora_B."), "a LoRA (load it with LoraLoaderModelOnly)"),
    ((".lora_up.", ".lora_down."), "a LoRA (load it with LoraLoaderModelOnly)"),
    (("latent_upscaler", "upsampler."), "a latent upscaler"),
    (("double_blocks.", "img_in."), "a Flux or HunyuanVideo DiT"),
    (("blocks.0.self_attn.", "blocks.0.cross_attn."), "a Wan DiT"),
    (("transformer_blocks.", "adaln_single."), "an LTX-Video or PixArt DiT"),
    (("joint_blocks.",), "an SD3 DiT"),
    (("input_blocks.", "output_blocks."), "a Stable Diffusion UNet"),
    (("model.layers.", "embed_tokens."), "a text encoder"),
    (("encoder.", "decoder."), "a VAE"),
)


class CheckpointError(ValueError):
    """A file that cannot be what it should be; the message names it and the fix."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors file's header, checked to describe the bytes the file holds."""

    path: Path
    tensors: dict[str, Tensor]
    metadata: dict[str, Any]
    data_start: int  # byte offset of the data section in the file

    def read(self, name: str, limit: int = MAX_QUANT_CONF_BYTES) -> bytes:
        """The raw bytes of a small tensor (a comfy_quant JSON, a scale)."""
        tensor = self.tensors[name]
        if tensor.end - tensor.start > limit:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {tensor.end - tensor.start:,}"
                                  f" bytes, too large for what it should hold; {FIX_DOWNLOAD}")
        with self.path.open("rb") as f:
            f.seek(self.data_start + tensor.start)
            return f.read(tensor.end - tensor.start)


def _refuse(path: Path, message: str) -> CheckpointError:
    return CheckpointError(f"{path}: {message}")


def read_checkpoint(path: str | Path, role: str = "model file") -> Checkpoint:
    """Read and check a safetensors header: the file exists, the header is safetensors' and
    its tensors cover the file's bytes exactly (a truncated download does not)."""
    path = Path(path)
    if path.is_dir():
        raise _refuse(path, f"is a folder; give the {role}'s .safetensors file inside it")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(9)  # the length, then the header's opening brace
            header_len = struct.unpack("<Q", head[:8])[0] if len(head) == 9 else None
            if header_len is None or head[8:] != b"{" or header_len > min(MAX_HEADER_BYTES,
                                                                          size - 8):
                if size == 0:
                    what = "is empty"
                elif header_len is None:
                    what = f"is {size:,} bytes, too short to be a safetensors file"
                elif head[8:] != b"{" or header_len > MAX_HEADER_BYTES:
                    what = ("is not a safetensors file (it does not start with a header length "
                            "and a JSON header); is it a .ckpt/.pt file renamed?")
                else:
                    what = (f"is truncated inside its header ({header_len + 8:,} bytes of "
                            f"header, the file has {size:,})")
                raise _refuse(path, f"{what}; {FIX_DOWNLOAD}")
            raw = b"{" + f.read(header_len - 1)
    except FileNotFoundError:
        raise _refuse(path, f"does not exist; put the {role} there or pick another") from None
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _refuse(path, f"is not a safetensors file (its header is not JSON); is it a "
                            f".ckpt/.pt file renamed, or a web page saved instead of the model? "
                            f"{FIX_DOWNLOAD}") from None
    if not isinstance(header, dict):
        raise _refuse(path, "is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    tensors = {name: _tensor(path, name, entry) for name, entry in header.items()}
    checkpoint = Checkpoint(path, tensors, metadata if isinstance(metadata, dict) else {},
                            8 + header_len)
    _check_coverage(checkpoint, size)
    return checkpoint


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(path: Path, name: str, entry: Any) -> Tensor:
    bad = _refuse(path, f"has a corrupt header: tensor {name!r} is described as "
                        f"{entry!r:.100}; {FIX_DOWNLOAD}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(map(_whole, shape))
            and isinstance(offsets, list) and len(offsets) == 2 and all(map(_whole, offsets))
            and offsets[0] <= offsets[1]):
        raise bad
    if dtype in DTYPE_BYTES:
        count = 1
        for dim in shape:
            count *= dim
        if count * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise _refuse(path, f"has a corrupt header: tensor {name!r} ({dtype} {shape}) needs "
                                f"{count * DTYPE_BYTES[dtype]:,} bytes but is given "
                                f"{offsets[1] - offsets[0]:,}; {FIX_DOWNLOAD}")
    return Tensor(dtype, tuple(shape), offsets[0], offsets[1])


def _check_coverage(checkpoint: Checkpoint, size: int) -> None:
    """The tensors tile the data section from 0 to its end, as safetensors requires."""
    path, spans = checkpoint.path, sorted((t.start, t.end, n) for n, t in
                                          checkpoint.tensors.items())
    position = 0
    for start, end, name in spans:
        if start != position:
            word = "overlaps another" if start < position else "leaves a gap before it"
            raise _refuse(path, f"has a corrupt header: tensor {name!r} {word}; {FIX_DOWNLOAD}")
        position = end
    listed, held = checkpoint.data_start + position, size
    if held < listed:
        raise _refuse(path, f"is truncated: its header lists {listed:,} bytes, the file has "
                            f"{held:,} ({held / listed:.0%}); the download or copy was cut "
                            f"short: {FIX_DOWNLOAD}")
    if held > listed:
        raise _refuse(path, f"has {held - listed:,} bytes after its last tensor (a safetensors "
                            f"file ends with it; ComfyUI refuses it); {FIX_DOWNLOAD}")


def _layer_conf(checkpoint: Checkpoint, layer: str) -> dict:
    name = f"{layer}.comfy_quant"
    where = f"{checkpoint.path}: layer {layer!r}"
    tensor = checkpoint.tensors[name]
    if tensor.dtype != "U8" or len(tensor.shape) != 1:
        raise CheckpointError(f"{where}: its comfy_quant is {tensor.dtype} {list(tensor.shape)}, "
                              f"not the uint8 bytes of a JSON object; {FIX_DOWNLOAD}")
    raw = checkpoint.read(name)
    try:
        conf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(f"{where}: its comfy_quant is not JSON ({raw[:40]!r}); the file "
                              f"is damaged or was written by a broken quantizer: "
                              f"{FIX_DOWNLOAD}") from None
    if not isinstance(conf, dict):
        raise CheckpointError(f"{where}: its comfy_quant is {conf!r:.60}, not an object such as "
                              f'{{"format": "int8_tensorwise"}}; {FIX_DOWNLOAD}')
    return conf


def check_quantization(checkpoint: Checkpoint,
                       formats: dict[str, tuple[frozenset[str], frozenset[str]]] | None = None
                       ) -> dict[str, int]:
    """Every quantized layer's `comfy_quant` against the formats ComfyUI knows; return the
    count of layers per format. `formats`: the running ComfyUI's (else `FORMATS`)."""
    formats = FORMATS if formats is None else formats
    counts: dict[str, int] = {}
    for name in sorted(n for n in checkpoint.tensors if n.endswith(".comfy_quant")):
        layer = name[: -len(".comfy_quant")]
        where = f"{checkpoint.path}: layer {layer!r}"
        conf = _layer_conf(checkpoint, layer)
        fmt = conf.get("format")
        if not isinstance(fmt, str) or fmt not in formats:
            known = ", ".join(sorted(formats))
            raise CheckpointError(f"{where}: its comfy_quant format is {fmt!r:.40}, which this "
                                  f"ComfyUI does not know (it knows {known}); update ComfyUI, or "
                                  f"use the file the H3 model page links")
        stored, scales = formats[fmt]
        weight = checkpoint.tensors.get(f"{layer}.weight")
        if weight is None:
            raise CheckpointError(f"{where}: it has a comfy_quant ({fmt}) but no weight; "
                                  f"{FIX_DOWNLOAD}")
        if stored and weight.dtype not in stored:
            raise CheckpointError(f"{where}: its comfy_quant says {fmt}, but its weight is stored "
                                  f"as {weight.dtype} (expected {' or '.join(sorted(stored))}); "
                                  f"ComfyUI would load it and compute garbage. The metadata "
                                  f"does not belong to these weights: {FIX_DOWNLOAD}")
        missing = sorted(s for s in scales if f"{layer}.{s}" not in checkpoint.tensors)
        if missing:
            raise CheckpointError(f"{where}: its {fmt} weight has no {', '.join(missing)}; "
                                  f"{FIX_DOWNLOAD}")
        params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
        for key in ("convrot_groupsize", "group_size"):
            value = conf.get(key, params.get(key))
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                          and value > 0):
                raise CheckpointError(f"{where}: its comfy_quant {key} is {value!r:.40}, not a "
                                      f"positive whole number; {FIX_DOWNLOAD}")
        counts[fmt] = counts.get(fmt, 0) + 1
    return counts


_PREFIX = re.compile(r"^(?:model\.diffusion_model\.|diffusion_model\.|model\.)")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def h3_dit_layout(checkpoint: Checkpoint) -> dict[str, int] | None:
    """{"blocks", "hidden", "heads"} of an H3 DiT file (ComfyUI detects H3 by its video and
    audio patch projections), or None when the file is not one."""
    names = {_PREFIX.sub("", n): t for n, t in checkpoint.tensors.items()}
    video, qkv, norm = (names.get(k) for k in ("video_patch_proj.weight",
                                                "blocks.0.attn.qkv_proj.weight",
                                                "blocks.0.attn.q_norm.weight"))
    if video is None or "audio_patch_proj.weight" not in names or qkv is None or norm is None:
        return None
    blocks = {int(m.group(1)) for n in names if (m := _BLOCK.match(n))}
    head_dim = norm.shape[0] if norm.shape else 0
    heads = qkv.shape[0] // (3 * head_dim) if head_dim and qkv.shape else 0
    return {"blocks": len(blocks), "hidden": video.shape[0] if video.shape else 0,
            "heads": heads}


def looks_like(checkpoint: Checkpoint) -> str:
    """What a file that is not an H3 DiT seems to be, from its tensor names."""
    names = list(checkpoint.tensors)
    for markers, what in LOOKS_LIKE:
        if all(any(m in n for n in names) for m in markers):
            return what
    shown = ", ".join(repr(n) for n in names[:3]) or "no tensors"
    return f"no model this pack knows (its first tensors: {shown})"


def check_dit_file(path: str | Path,
                   formats: dict[str, tuple[frozenset[str], frozenset[str]]] | None = None
                   ) -> Checkpoint:
    """The H3 DiT at `path`, checked whole: intact, its quantization readable, and H3's."""
    checkpoint = read_checkpoint(path, "H3 DiT")
    layout = h3_dit_layout(checkpoint)
    if layout is None:
        raise CheckpointError(f"{checkpoint.path} is not a MiniMax H3 DiT: it looks like "
                              f"{looks_like(checkpoint)}. Load {H3_DIT_FILE} (models/"
                              f"diffusion_models) with UNETLoader")
    check_quantization(checkpoint, formats)
    return checkpoint
