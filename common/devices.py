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


def helper_devices(root: torch.device, names: Sequence[str] | None,
                   visible: int) -> list[torch.device]:
    """A mode's helpers as written (`names`), or None: every other of the `visible` GPUs."""
    if names is None:
        return [torch.device("cuda", i) for i in range(visible)
                if root.type != "cuda" or i != root.index]
    return list(parse_devices(",".join(names)) or ())


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


CFG_SPLIT_NODE = "MultiGPU CFG Split"


def cfg_split_groups(leads: Sequence[torch.device], helpers: Sequence[torch.device]
                     ) -> tuple[list[list[torch.device]] | None, str | None]:
    """Sequence parallel inside ComfyUI's MultiGPU CFG Split (2x2 on four GPUs): each GPU CFG
    Split runs a cond on (`leads`, the root first) leads one group, and the sequence helpers
    CFG Split does not use are dealt to the groups in turn (the root's first). Returns (the
    groups, lead first, None) or (None, why not): every group needs the same number (>= 1) of
    helpers, or the slower group would set the pace and one lead would run alone."""
    free = [d for d in helpers if d not in leads]
    where = ", ".join(str(d) for d in leads)
    if not free or len(free) % len(leads):
        left = ", ".join(str(d) for d in free) or "none"
        return None, (f"{CFG_SPLIT_NODE} (ComfyUI's node) runs a cond on each of {where}; "
                      f"sequence parallel beside it needs the same number of helper GPUs for "
                      f"each of them, from the GPUs CFG Split does not use, and {left} are "
                      f"left. Four GPUs run as 2x2 with CFG Split's max_gpus at 2 and "
                      f"sequence helpers 'auto'; else set {CFG_SPLIT_NODE}'s max_gpus to 1 or "
                      f"remove it, or switch the pack's sequence off")
    groups = [[lead, *free[i::len(leads)]] for i, lead in enumerate(leads)]
    return groups, None
