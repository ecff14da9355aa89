"""The one place that makes a device current (`torch.cuda.device` is HIP's on ROCm).

ComfyUI leaves one GPU current while a model placed on another runs; the guard, the sequence
mode's helper threads, Dual-Sage's shares and the decode's shares all enter this context.
"""

from __future__ import annotations

import contextlib
from typing import Any


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
