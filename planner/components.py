"""Sizes of the H3 components: the official files built in, or real files' safetensors headers.

A safetensors file starts with an 8-byte little-endian header length and a JSON header listing
every tensor's dtype, shape and byte offsets, so a file's tensor bytes (and the DiT's per-block
bytes) are read without loading a single tensor.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from ..common import geometry

GB = 1000**3
GiB = 1024**3


@dataclass(frozen=True)
class ComponentSizes:
    """Bytes of each component as loaded (weights only)."""

    dit_bytes: int
    dit_block_bytes: int  # one of the 50 DiT blocks (the token refiner's blocks are alike)
    text_encoder_bytes: int
    video_vae_bytes: int
    audio_vae_bytes: int
    upscaler_bytes: int
    lora_bytes: int  # turbo LoRA (0 when not used)
    source: str = "official H3 files (built in)"

    @property
    def dit_other_bytes(self) -> int:
        """DiT bytes outside the 50 blocks: refiner, embeddings, output heads."""
        return max(0, self.dit_bytes - geometry.BLOCKS * self.dit_block_bytes)

    @property
    def vae_bytes(self) -> int:
        return self.video_vae_bytes + self.audio_vae_bytes


# official local workflow files (H3_FACTS section 1)
_DIT_FILE = 19.53 * GB
_BLOCKS_AND_REFINER = geometry.BLOCKS + geometry.REFINER_BLOCKS
_NON_BLOCK_BF16 = 2 * (5120 * 5376)  # condition_proj; patch projections and heads are tiny

OFFICIAL = ComponentSizes(
    dit_bytes=int(_DIT_FILE),
    dit_block_bytes=int((_DIT_FILE - _NON_BLOCK_BF16) / _BLOCKS_AND_REFINER),
    text_encoder_bytes=int(14.61 * GB),
    video_vae_bytes=int(4.85 * GB),
    audio_vae_bytes=int(0.56 * GB),
    upscaler_bytes=int(0.69 * GB),
    lora_bytes=int(1.8 * GiB),
)

BLOCK_PARAMS = (
    geometry.HIDDEN * 3 * geometry.INNER
    + geometry.INNER * geometry.HIDDEN
    + geometry.HIDDEN * 2 * geometry.FFN
    + geometry.FFN * geometry.HIDDEN
)  # 385,351,680 (the four linears)


def bf16_sizes(base: ComponentSizes = OFFICIAL) -> ComponentSizes:
    """The DiT held in bf16 (our full-size twin, or a bf16 checkpoint): 735 MiB per block."""
    block = BLOCK_PARAMS * 2 + 4 * geometry.HIDDEN * 2  # + norms
    other = _NON_BLOCK_BF16 + geometry.REFINER_BLOCKS * block
    return replace(base, dit_bytes=geometry.BLOCKS * block + other, dit_block_bytes=block,
                   source="DiT in bf16")


_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}


def read_safetensors_tensor_bytes(path: str | Path) -> dict[str, int]:
    """{tensor name: bytes} from a safetensors header, reading only the header.

    Every refusal names the file: a missing path, a directory, an unreadable file, or a header
    that is not safetensors' (a JSON object of {name: {dtype, shape, data_offsets}}).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"model file {str(path)!r} is a directory; give the path of the DiT's "
                         f".safetensors file inside it")
    if not path.is_file():
        raise ValueError(f"model file {str(path)!r} does not exist; give the path of a "
                         f".safetensors file")
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError(f"{path} is not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > 100 * 1024 * 1024:
                raise ValueError(f"{path} is not a safetensors file (header of {header_len} "
                                 f"bytes)")
            raw = f.read(header_len)
    except OSError as exc:
        raise ValueError(f"model file {str(path)!r} cannot be read ({exc.strerror or exc})"
                         ) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({exc})"
                         ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is a "
                         f"{type(header).__name__}, not an object of tensors")
    sizes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0
                        for o in offsets) and offsets[1] >= offsets[0]):
            raise ValueError(f"{path} has a corrupt safetensors header: tensor {name!r} has no "
                             f"valid data_offsets ({info!r:.80}); re-download the file")
        sizes[name] = offsets[1] - offsets[0]
    return sizes


_BLOCK_KEY = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def dit_sizes_from_file(path: str | Path, base: ComponentSizes = OFFICIAL) -> ComponentSizes:
    """Replace the DiT numbers by a real checkpoint's (total and largest block)."""
    sizes = read_safetensors_tensor_bytes(path)
    per_block: dict[int, int] = {}
    for name, nbytes in sizes.items():
        if "token_refiner" in name:
            continue
        m = _BLOCK_KEY.search(name)
        if m:
            per_block[int(m.group(1))] = per_block.get(int(m.group(1)), 0) + nbytes
    if not per_block:
        raise ValueError(f"{path} has no 'blocks.N.' tensors: is it the H3 DiT checkpoint?")
    return replace(base, dit_bytes=sum(sizes.values()), dit_block_bytes=max(per_block.values()),
                   source=f"DiT from {Path(path).name}")


def file_bytes(path: str | Path) -> int:
    return sum(read_safetensors_tensor_bytes(path).values())


# ComfyAttention (comfy/ldm/modules/attention.py, newest files; absent in 0.33.0) reads a
# module's "<prefix>comfy_attention.config" tensor: JSON bytes whose "attention" names the
# kernel the checkpoint prefers; ComfyUI runs it where the kernel is available.
_CHECKPOINT_KERNELS = {"comfy_kitchen_int8": "ck"}
_ATTENTION_CONFIG = "comfy_attention.config"


def checkpoint_attention(path: str | Path) -> str | None:
    """The attention kernel the DiT file's attention config prefers ("ck"), or None when its
    header states none (or one the planner has no rates for)."""
    path = Path(path)
    read_safetensors_tensor_bytes(path)  # the same refusals for a bad file
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        keys = sorted(k for k in header if k.endswith(_ATTENTION_CONFIG))
        if not keys:
            return None
        start, end = header[keys[0]]["data_offsets"]
        if end - start > 1 << 20:  # a config is a few hundred bytes
            return None
        f.seek(8 + header_len + start)
        raw = f.read(end - start)
    try:
        method = json.loads(raw.decode("utf-8")).get("attention")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return _CHECKPOINT_KERNELS.get(method)
