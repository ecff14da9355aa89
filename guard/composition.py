"""The pack beside ComfyUI's own MultiGPU CFG Split: what composes and what is refused.

MultiGPU CFG Split (`MultiGPU_WorkUnits`) gives each extra GPU a fresh copy of the DiT from the
loader and runs cond and uncond on the copies in threads. The pack's DiT features are written
for one copy: sequence parallel and Dual-Sage run shares on other GPUs with one per-forward
state (two threads would share it, and their shares would land on the GPUs CFG Split uses), the
prefetcher's slots and chunking's wrappers belong to the copy they were installed on. So with
CFG Split's clones present these features are refused, before any weight moves: at the node
when CFG Split comes first, else when sampling starts (the device guard's OUTER_SAMPLE wrapper
runs before ComfyUI loads the models). The placement and the device guard compose: every copy
runs with its own GPU current. At max_gpus 1 (or on one GPU) CFG Split makes no clones and
everything composes.
"""

from __future__ import annotations

from typing import Any

from ..comfy_seam import protocol
from ..comfy_seam.clones import cfg_split_devices

# the pack's DiT features that cannot run on CFG Split's per-GPU copies
REFUSED_WITH_CFG_SPLIT = ("sequence", "dual_sage", "prefetch", "chunking")
NODE = "MultiGPU CFG Split"


def cfg_split_refusal(patcher: Any, features: tuple[str, ...] | None = None) -> str | None:
    """Why `features` (default: the ones installed on the patcher) cannot run beside CFG
    Split's clones of this patcher, or None when they compose."""
    devices = cfg_split_devices(patcher)
    if len(devices) < 2:
        return None
    if features is None:
        features = tuple(f for f in REFUSED_WITH_CFG_SPLIT if protocol.has(patcher, f))
    clash = [f for f in features if f in REFUSED_WITH_CFG_SPLIT]
    if not clash:
        return None
    where = ", ".join(str(d) for d in devices)
    names = ", ".join(clash)
    return (f"{NODE} (ComfyUI's node) runs a copy of the DiT on each of {where}, and the "
            f"pack's {names} cannot run on those copies (they split or stream one copy). "
            f"Use one or the other: set {NODE}'s max_gpus to 1 or remove it, or switch the "
            f"pack's {names} off")


def check_cfg_split(patcher: Any, features: tuple[str, ...] | None = None) -> None:
    """ValueError naming CFG Split and the fix when the two cannot compose."""
    refusal = cfg_split_refusal(patcher, features)
    if refusal is not None:
        raise ValueError(refusal)
