"""The mode's status line and its warnings (once per kind), as prose for the node's output."""

from __future__ import annotations

import logging
from typing import Any

from . import policy

log = logging.getLogger(__name__)

OUR_BINDING = "helper weights bound by the pack (ComfyUI cannot clone this model: {why})"
COMFY_CLONES = "helper weights: ComfyUI-managed clones (deepclone_multigpu, loaded by ComfyUI)"
_warned: set[str] = set()


def warn_once(message: str) -> None:
    key = message.split(":")[0]
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def weights_words(mode: Any) -> str:
    """Whose helper weights run: ComfyUI's clones, or the pack's binding (and why)."""
    if mode.clone_refusal is None:
        words = COMFY_CLONES
        if mode.dynamic_vram:
            words += ", under DynamicVRAM"
        return words
    return OUR_BINDING.format(why=mode.clone_refusal) + f": {mode.config.helper_weights}"


def exact_words(mode: Any) -> str:
    """What the status claims about exactness, for the blocks' weight formats."""
    rule = policy.format_rule(mode.gemm_devices(), mode.weight_formats())
    if rule.floor is None:
        return f"exact only where known: {rule.why}, so steps run another way"
    if rule.base == 1:
        rows = "row shares of any size (INT8 ConvRot weights)"
    else:
        rows = f"row shares >= {mode.split.exact_min_rows:,}"
    return (f"exact ({rows}, more with on-activation LoRA; shorter steps run another way)")


def status_line(mode: Any) -> str:
    """The line `protocol.record_status` shows for the mode on a patcher."""
    if mode.dynamic_vram and mode.clone_refusal is not None:
        return (f"{policy.DYNAMIC_VRAM_OFF}, and {mode.clone_refusal}; each step runs on "
                "Dual-Sage's heads where it is applied, else on one GPU")
    split = mode.split
    helpers = ", ".join(str(d) for d in mode.devices[1:])
    rows = ":".join(f"{w:g}" for w in split.row_weights)
    heads = "+".join(str(c) for c in split.head_counts)
    return (f"sequence parallel {mode.config.parallel.value}: root {mode.devices[0]}, "
            f"helpers {helpers}; rows {rows}, heads {heads} in chunks of >= "
            f"{split.chunk_heads_for(1 << 30)}; transport {'/'.join(sorted(mode.modes))}; "
            f"{weights_words(mode)}; {exact_words(mode)}; mode "
            f"chosen per step from the token count"
            + (f"; {mode.config.note}" if mode.config.note else "")
            + "".join(f"; {note}" for note in mode.notes))
