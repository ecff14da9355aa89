"""Sequence parallel inside ComfyUI's MultiGPU CFG Split (2x2 on four GPUs): one group a cond.

CFG Split (`comfy/multigpu.py`) runs each cond's model call on its own copy of the DiT, the
root's on the sampling thread and each extra copy's on a worker thread of its pool. Where the
sequence helpers divide evenly over those copies (`common.devices.cfg_split_groups`), each copy
leads a group of its own: a `SequenceParallel` whose root share is that copy (upstream's block,
through the patch's `original_block` on the copy's thread) and whose helpers are ComfyUI-managed
clones on GPUs CFG Split does not use. The groups share nothing at run time: each keeps its own
per-forward state, runner, links and share threads, and a forward finds its group by the model
that runs it (DIFFUSION_MODEL wrapper) and by its own options dict (block patches).

Each group's helper clones ride as additional models on the copy that leads it (the root's on
the root): ComfyUI's `match_multigpu_clones` (run by `prepare_sampling` before it loads the
models) carries a copy's additional models over to the copy it rebuilds and, finding models
of the same `clone_base_uuid` there, does not deep-clone the root's helpers onto that copy's
GPU. So every GPU holds one DiT, loaded by ComfyUI. Every base clone is made before any is
registered: a deep clone copies the root's additional models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..comfy_seam import clones as comfy_clones
from ..common.devices import CFG_SPLIT_NODE, cfg_split_groups

# (devices, lead first; the lead's diffusion model; its base model) -> a SequenceParallel
MakeGroup = Callable[[list[torch.device], Any, Any], Any]


def group_config(config: Any, all_devices: list[torch.device],
                 devices: list[torch.device]) -> Any:
    """One group's config: its helpers, and the mode's split and GPU rates for its devices (a
    lead the mode does not list, CFG Split's own GPU, takes the root's)."""
    picks = [all_devices.index(d) if d in all_devices else 0 for d in devices]
    split = config.split
    weights = split.replace(",", ":").split(":")
    if split.strip().lower() not in ("", "auto") and len(weights) == len(all_devices):
        split = ":".join(weights[i].strip() for i in picks)
    speeds = config.gpu_speeds
    if speeds is not None and len(speeds) == len(all_devices):
        speeds = tuple(speeds[i] for i in picks)
    elif speeds is not None:
        speeds = None
    return replace(config, helpers=tuple(str(d) for d in devices[1:]), split=split,
                   gpu_speeds=speeds)


class CfgGroups:
    """The groups of one patched model beside CFG Split. A run's groups are made when it
    starts and let go of CFG Split's copy when it ends (the copy is ComfyUI's: holding it
    would keep a whole DiT alive after the graph dropped it); their base clones, ours, are
    kept across runs per device list."""

    def __init__(self, make_group: MakeGroup):
        self.make_group = make_group
        self.bases: dict[tuple[str, ...], dict[int, Any]] = {}
        self.active: list[Any] = []  # while a run that CFG Split splits is sampling
        self.finished: list[Any] = []  # the last such run's groups, detached
        self.steps: dict[str, int] = {}  # the groups' forwards by mode, over the model's life
        self.notes: dict[str, None] = {}

    def begin(self, root: Any, helpers: list[torch.device]) -> list[Any] | None:
        """Before ComfyUI prepares sampling: the groups for CFG Split's copies of `root`, their
        helper clones matched and registered; None when CFG Split made no copies. ValueError
        (before any clone is made) when the helpers do not divide over the copies."""
        leads = comfy_clones.cfg_split_devices(root)
        if len(leads) < 2:
            return None
        groups, why = cfg_split_groups(leads, helpers)
        if groups is None:
            raise ValueError(why)
        owners = [root, *comfy_clones.cfg_split_clones(root)]
        active = []
        for devices, owner in zip(groups, owners, strict=True):
            group = self.make_group(list(devices), comfy_clones.diffusion_model(owner),
                                    owner.model)
            group.bases = self.bases.setdefault(tuple(str(d) for d in devices), {})
            active.append((group, owner))
        for group, _ in active:
            group.make_bases(root)
        clones: list[Any] = []
        for group, owner in active:
            clones += group.match_clones(root, owner=owner)
        self.active = [group for group, _ in active]
        return clones

    def end(self) -> None:
        """After sampling: each group's buffers freed and CFG Split's copy let go."""
        ended, self.active = self.active, []
        for group in ended:
            group.clones = None
            group.release()
            for name, count in group.steps.items():
                self.steps[name] = self.steps.get(name, 0) + count
            self.notes.update(group.notes)
            group.detach_model()
        self.finished = ended

    def for_model(self, diffusion_model: Any) -> Any | None:
        """The active group whose lead runs this diffusion model."""
        return next((g for g in self.active if g.diffusion_model is diffusion_model), None)

    def owner_of(self, options: Any) -> Any | None:
        """The active group in whose forward these transformer_options are."""
        for group in self.active:
            forward = group.forward
            if forward is not None and forward.options is options:
                return group
        return None

    def release(self) -> None:
        for group in self.active:
            group.release()

    def words(self) -> str:
        """The status line's words for the last run beside CFG Split ("" before any)."""
        if not self.finished:
            return ""
        devices = [[str(d) for d in group.devices] for group in self.finished]
        pairs = ", ".join("+".join(d) for d in devices)
        shape = f"{len(devices)}x{len(devices[0])}"
        ran = ", ".join(f"{name} {count}" for name, count in self.steps.items() if count)
        notes = "".join(f"; {note}" for note in self.notes)
        return (f"beside {CFG_SPLIT_NODE}: one sequence group a cond ({shape}): {pairs}"
                + (f"; group forwards: {ran}" if ran else "") + notes)
