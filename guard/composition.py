"""The pack beside ComfyUI's own MultiGPU CFG Split: what composes and what is refused.

MultiGPU CFG Split (`MultiGPU_WorkUnits`) gives each extra GPU a fresh copy of the DiT from the
loader and runs cond and uncond on the copies in threads. Dual-Sage runs its head shares with
one per-forward state (two threads would share it), and the prefetcher's slots and chunking's
wrappers belong to the copy they were installed on: with CFG Split's clones present these are
refused, before any weight moves: at the node when CFG Split comes first, else when sampling
starts (the device guard's OUTER_SAMPLE wrapper runs before ComfyUI loads the models).

Sequence parallel composes when it can run one group per CFG Split GPU (2x2 on four GPUs:
`common.devices.cfg_split_groups`, the same helpers for each cond): each cond's copy leads a
group of its own, on GPUs CFG Split does not use (`sequence.cfg_groups`); otherwise it is
refused the same way, saying how many helpers are left. The placement and the device guard
compose: every copy runs with its own GPU current. At max_gpus 1 (or on one GPU) CFG Split
makes no clones and everything composes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comfy_seam import protocol
from ..comfy_seam.clones import cfg_split_devices
from ..comfy_seam.devices import gpu_count, root_device
from ..common.devices import CFG_SPLIT_NODE, cfg_split_groups, helper_devices

# the pack's DiT features that cannot run on CFG Split's per-GPU copies
REFUSED_WITH_CFG_SPLIT = ("dual_sage", "prefetch", "chunking")
# ... and the one that runs inside them, one group per copy, where the helpers divide evenly
GROUPED_WITH_CFG_SPLIT = ("sequence",)
NODE = CFG_SPLIT_NODE


def cfg_split_refusal(patcher: Any, features: tuple[str, ...] | None = None,
                      config: Any = None) -> str | None:
    """Why `features` (default: the ones installed on the patcher) cannot run beside CFG
    Split's clones of this patcher, or None when they compose. `config`: the sequence mode's
    config when it is being applied now (its helpers), else its installed state is read."""
    devices = cfg_split_devices(patcher)
    if len(devices) < 2:
        return None
    known = REFUSED_WITH_CFG_SPLIT + GROUPED_WITH_CFG_SPLIT
    if features is None:
        features = tuple(f for f in known if protocol.has(patcher, f))
    if "sequence" in features:
        _, why = cfg_split_groups(devices, sequence_helpers(patcher, config))
        if why is not None:
            return why
    clash = [f for f in features if f in REFUSED_WITH_CFG_SPLIT]
    if not clash:
        return None
    where = ", ".join(str(d) for d in devices)
    names = ", ".join(clash)
    return (f"{NODE} (ComfyUI's node) runs a copy of the DiT on each of {where}, and the "
            f"pack's {names} cannot run on those copies (they split or stream one copy). "
            f"Use one or the other: set {NODE}'s max_gpus to 1 or remove it, or switch the "
            f"pack's {names} off")


def sequence_helpers(patcher: Any, config: Any = None) -> list[torch.device]:
    """The sequence mode's helpers: the installed state's (resolved when it was applied), or
    the config's (None: every other GPU ComfyUI uses)."""
    if config is None:
        state = protocol.find(patcher, "sequence")
        devices = getattr(state, "devices", None)
        if devices is not None:
            return list(devices[1:])
    return helper_devices(root_device(patcher), getattr(config, "helpers", None), gpu_count())


def check_cfg_split(patcher: Any, features: tuple[str, ...] | None = None,
                    config: Any = None) -> None:
    """ValueError naming CFG Split and the fix when the two cannot compose."""
    refusal = cfg_split_refusal(patcher, features, config)
    if refusal is not None:
        raise ValueError(refusal)
