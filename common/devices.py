"""Devices as the user writes them ("auto", "gpu:0,cuda:2,3") and the checks every feature makes
of a root and its helpers before any weight moves (Dual-Sage, the sequence mode, the decode)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comfy_seam.devices import gpu_count, hidden_gpu_hint


def parse_devices(text: str) -> tuple[torch.device, ...] | None:
    """"auto" -> None (every other visible GPU); "gpu:0,cuda:2,3" -> (cuda:0, cuda:2, cuda:3)."""
    text = text.strip().lower()
    if text in ("auto", ""):
        return None
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name = part.replace("gpu:", "cuda:")
        if name.isdigit():
            name = f"cuda:{name}"
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"helper device {part!r} is not a device; write 'gpu:0' or 'cuda:0' "
                             "(or 'auto')") from None
        if device.type == "cuda" and device.index is None:
            raise ValueError(f"helper device {part!r} needs an index, e.g. 'gpu:0'")
        out.append(device)
    return tuple(out)


def validate_devices(root: torch.device, helpers: Sequence[torch.device]) -> None:
    """ValueError for an unknown GPU or a helper equal to the root ("cpu" only in CPU tests)."""
    count = gpu_count()
    for device in helpers:
        if device.type == "cpu":
            if root.type != "cpu":
                raise ValueError(f"helper device {device} is the CPU; helpers must be GPUs "
                                 "(the CPU stands in for GPUs only in tests)")
            continue
        if device.type != "cuda":
            raise ValueError(f"helper device {device} is not a CUDA/ROCm GPU; use 'gpu:N'")
        if device.index >= count:
            raise ValueError(f"helper device {device}: {hidden_gpu_hint(device.index)}")
        if root.type == "cuda" and device.index == (root.index or 0):
            raise ValueError(f"helper device {device} is the root GPU running the model; pick "
                             "another GPU as helper")
