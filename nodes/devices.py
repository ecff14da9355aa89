"""Device names as ComfyUI spells them ("default", "cpu", "gpu:N") and how we show GPUs.

Pure Python: parsing and formatting are unit-tested on CPU. Only `gpu_inventory()` touches
torch, lazily. ComfyUI's "gpu:N" is the N-th entry of `model_management.get_all_torch_devices()`,
which for CUDA and ROCm is `cuda:N` in torch's numbering (after CUDA_VISIBLE_DEVICES /
HIP_VISIBLE_DEVICES), so index N here is torch's index N. Every status line names a GPU by
index *and* model name and memory, because "device 1" alone is what users mix up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .inputs import shown

GiB = 1024**3

# ASCII digits only (str.isdigit() and a Unicode \d also accept '²' and '١', which int() then
# refuses or reads as another number), and few of them (int() refuses 4300 digits)
_GPU_RE = re.compile(r"^\s*(?:(?:gpu|cuda|hip)\s*:\s*)?([0-9]{1,6})\s*$",
                     re.IGNORECASE | re.ASCII)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as torch sees it."""

    index: int
    name: str
    total_bytes: int

    @property
    def option(self) -> str:
        return device_option(self.index)

    def describe(self) -> str:
        """'gpu:1 NVIDIA GeForce RTX 5060 Ti 16 GiB'."""
        return f"{self.option} {self.name} {self.total_bytes / GiB:.0f} GiB"


def device_option(index: int) -> str:
    """GPU index -> ComfyUI's device option string."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"a GPU index must be a non-negative integer, got {index!r}")
    return f"gpu:{index}"


def parse_device(text: str) -> int | str:
    """'gpu:1' -> 1; 'cuda:1' -> 1 (same numbering); '1' -> 1; 'auto'/'default' -> 'auto';
    'cpu' -> 'cpu'. Anything else raises ValueError naming the accepted forms."""
    if not isinstance(text, str):
        raise ValueError(f"a device must be a string such as 'gpu:0', got {shown(text)}")
    lowered = text.strip().lower()
    if lowered in ("auto", "default", ""):
        return "auto"
    if lowered == "cpu":
        return "cpu"
    match = _GPU_RE.match(lowered)
    if match:
        return int(match.group(1))
    raise ValueError(
        f"device {shown(text)} is not understood; use 'auto', 'cpu' or ComfyUI's 'gpu:N' "
        f"(gpu:0 is the first GPU torch lists)"
    )


def parse_device_list(text: str) -> list[int] | str:
    """'gpu:0' or 'gpu:0,gpu:2' -> [0] / [0, 2]; 'auto' -> 'auto'. Duplicates are refused."""
    if isinstance(text, str) and text.strip().lower() in ("auto", "default", ""):
        return "auto"
    parts = [p for p in str(text).split(",") if p.strip()]
    indices: list[int] = []
    for part in parts:
        value = parse_device(part)
        if not isinstance(value, int):
            raise ValueError(f"helper list {shown(text)}: {shown(part.strip())} is not a GPU; "
                             f"list GPUs as 'gpu:0,gpu:2' or write 'auto'")
        if value in indices:
            raise ValueError(f"helper list {shown(text)} names gpu:{value} twice")
        indices.append(value)
    return indices


def check_index(index: int, gpus: list[GpuInfo], role: str) -> str | None:
    """None when gpu:index exists, else a message the user can act on."""
    if 0 <= index < len(gpus):
        return None
    have = ", ".join(g.describe() for g in gpus) or "no GPU"
    return f"{role} gpu:{index} does not exist on this machine (it has {have})"


def gpu_inventory() -> list[GpuInfo]:
    """The GPUs this ComfyUI computes on (CUDA or ROCm), in ComfyUI's gpu:N order: none when
    ComfyUI runs on the CPU (`--cpu`) even where torch sees GPUs."""
    try:
        import torch
    except ImportError:
        return []
    from ..comfy_seam.devices import gpu_count
    from ..comfy_seam.memory import comfy_runs_on_cpu

    if not torch.cuda.is_available() or comfy_runs_on_cpu():
        return []
    found = []
    for i in range(gpu_count()):  # ComfyUI's GPUs (--cuda-device), not all torch sees
        props = torch.cuda.get_device_properties(i)
        found.append(GpuInfo(i, props.name, int(props.total_memory)))
    return found


def describe_index(index: int | None, gpus: list[GpuInfo]) -> str:
    """'gpu:1 NVIDIA H200 134 GiB' when known, 'gpu:1' otherwise, 'cpu' for None."""
    if index is None:
        return "cpu"
    for gpu in gpus:
        if gpu.index == index:
            return gpu.describe()
    return device_option(index)
