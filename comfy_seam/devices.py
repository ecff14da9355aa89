"""The one place that makes a device current (`torch.cuda.device` is HIP's on ROCm), and the
one reading of the device a patcher's DiT runs on.

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
