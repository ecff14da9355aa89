"""The one place that makes a device current (`torch.cuda.device` is HIP's on ROCm), the one
reading of the device a patcher's DiT runs on, and the one count of the GPUs ComfyUI uses.

ComfyUI leaves one GPU current while a model placed on another runs; the guard, the sequence
mode's helper threads, Dual-Sage's shares and the decode's shares all enter this context.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def device_context(device: Any) -> contextlib.AbstractContextManager:
    """Make `device` current while the block runs (CUDA/ROCm and XPU; nothing elsewhere)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    xpu = getattr(torch, "xpu", None)
    if device.type == "xpu" and device.index is not None and xpu is not None:
        return xpu.device(device)
    return contextlib.nullcontext()


def root_device(patcher: Any) -> torch.device:
    """The device a patcher's DiT runs on: its `load_device` (ModelPatcher, 0.33.0 and newest),
    a bare "cuda" read as the current CUDA device (as torch places a tensor sent there)."""
    import torch

    root = torch.device(patcher.load_device)
    if root.type == "cuda" and root.index is None:
        root = torch.device("cuda", torch.cuda.current_device())
    return root


def torch_gpu_count() -> int:
    """GPUs torch sees (CUDA or ROCm), whatever ComfyUI uses of them."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_count() -> int:
    """GPUs ComfyUI computes on: the CUDA/ROCm entries of ComfyUI's own device list
    (`get_all_torch_devices`, after `--cuda-device`, `--cpu` and its per-platform default) when
    ComfyUI is loaded; torch's count outside ComfyUI (the command line, plain tests).

    Every feature counts GPUs here, so none runs a share on a GPU that ComfyUI does not see.
    """
    import torch

    seen = torch_gpu_count()
    from . import runtime

    mm = runtime.model_management()
    listing = getattr(mm, "get_all_torch_devices", None) if mm is not None else None
    if listing is None:
        return seen
    try:
        devices = listing(exclude_current=False)
    except Exception:  # noqa: BLE001 - a ComfyUI that cannot list: torch's count stands
        return seen
    return min(seen, sum(1 for d in devices if torch.device(d).type == "cuda"))


def hidden_gpu_hint(index: int) -> str:
    """Why gpu:index is not usable here and what to do, naming ComfyUI's start flag when torch
    sees the GPU but ComfyUI does not."""
    used, seen = gpu_count(), torch_gpu_count()
    if index < seen:
        return (f"gpu:{index} is hidden from ComfyUI: it computes on {used} of the {seen} GPU(s) "
                f"torch sees (started with --cuda-device, --cpu, or on Windows without "
                f"--cuda-device all); start ComfyUI with --cuda-device all to use it")
    return (f"gpu:{index} does not exist: this machine has {used} GPU(s)"
            + (f" (gpu:0..gpu:{used - 1})" if used else ""))
