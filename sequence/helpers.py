"""The helpers' side of the mode: their ComfyUI clones, or the pack's own weight binding.

`HelperLifecycle` is the part of `patches.SequenceParallel` that owns what lives on the helper
GPUs: each helper's clone (`comfy_seam.clones`: made once with ComfyUI's `deepclone_multigpu`,
matched to each run's patcher before ComfyUI prepares sampling, loaded and patched by ComfyUI,
unloaded after), or, for a model ComfyUI cannot clone, the blocks' weights bound by the pack
(`weights.HelperWeights`: a replica or streamed slots, refreshed when the root's weights
change); a share's block call on either; and the release after sampling, a detach or a failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..comfy_seam import clones as comfy_clones
from ..comfy_seam.h3 import sampled_patcher
from ..comfy_seam.memory import free_vram_bytes
from ..exchange.mode import ParallelMode
from . import sizing
from .plan import positional
from .runner import BlockCall, SequenceRunner
from .status import warn_once
from .weights import REPLICA, STREAM, HelperWeights, choose_mode

GIB = 1 << 30


class HelperLifecycle:
    """Helper clones / bound weights of one patched model (mixed into `SequenceParallel`)."""

    # set by SequenceParallel.__init__
    config: Any
    split: Any
    blocks: list[torch.nn.Module]
    base_model: Any
    clone_refusal: str | None
    bases: dict[int, Any]
    clones: dict[int, Any] | None
    helper_weights: dict[int, HelperWeights]
    weights_reason: str
    failed_lengths: set[int]
    steps: dict[str, int]
    runner: SequenceRunner | None
    transport: Any
    _note: Callable[[str], None]  # a run-time refusal the status line names
    cfg: Any  # `cfg_groups.CfgGroups`: the groups beside ComfyUI's CFG Split

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self.split.devices

    # ------------------------------------------------------------------ ComfyUI's clones
    def make_bases(self, root: Any) -> None:
        """Each helper's base clone (ComfyUI's deepclone_multigpu of `root`), made once."""
        if self.clone_refusal is not None or root is None or \
                self.config.parallel is ParallelMode.OFF:
            return
        for k in range(1, len(self.devices)):
            if self.bases.get(k) is None:
                self.bases[k] = comfy_clones.make_clone(root, self.devices[k])

    def match_clones(self, root: Any, owner: Any = None) -> list[Any]:
        """Before ComfyUI prepares sampling: each helper's clone matched to `root` (this run's
        patcher) and handed to ComfyUI as an additional model of `owner` (default the root;
        beside CFG Split the copy leading this group), so ComfyUI loads and patches it."""
        if self.clone_refusal is not None or root is None or \
                self.config.parallel is ParallelMode.OFF:
            return []
        self.make_bases(root)
        clones, left_off = {}, set()
        for k in range(1, len(self.devices)):
            clones[k], missing = comfy_clones.match_clone(root, self.bases[k])
            left_off.update(missing)
        comfy_clones.set_clones(root if owner is None else owner, list(clones.values()))
        for clone in clones.values():
            comfy_clones.pre_run(clone)
        if left_off:
            self._note(f"the helper clones run without {len(left_off)} object patch(es) of "
                       f"the root's blocks that cannot move to another model "
                       f"({sorted(left_off)[0]}, ...): the helper shares run upstream's plain "
                       "block there")
        self.clones = clones
        return list(clones.values())

    def outer_sample_wrapper(self) -> Callable:
        def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
            root = sampled_patcher(executor)
            # beside ComfyUI's CFG Split: one group a cond (`cfg_groups`), else the helpers
            clones = None
            if root is not None and self.config.parallel is not ParallelMode.OFF:
                clones = self.cfg.begin(root, list(self.devices[1:]))
            if clones is None:
                clones = self.match_clones(root)
            try:
                return executor(*args, **kwargs)
            finally:
                for clone in clones:
                    comfy_clones.cleanup(clone)
                self.clones = None
                self.cfg.end()
                if not self.config.keep_weights:
                    self.release()
                    for clone in clones:
                        comfy_clones.unload(clone)

        return wrapper

    # ------------------------------------------------------------------ one share's call
    def _helper_call(self, k: int, index: int) -> tuple[BlockCall, torch.nn.Module]:
        """Share k's block call: upstream's block of its ComfyUI clone, or our bound copy."""
        if self.clone_refusal is None:
            assert self.clones is not None
            block = comfy_clones.diffusion_model(self.clones[k]).blocks[index]

            def clone_call(args: dict, options: dict) -> torch.Tensor:
                return block(*positional(args), transformer_options=options)

            return clone_call, block
        weights = self.helper_weights[k]

        def copy_call(args: dict, options: dict) -> torch.Tensor:
            weights.begin(index)  # streamed: its slot filled (helper stream waits for it)
            with weights.use(index) as module:
                out = module(*positional(args), transformer_options=options)
            weights.end(index)
            return out

        return copy_call, self.blocks[index]

    # ------------------------------------------------------------------ our own binding
    def _prepare(self, seq_len: int, prefetch: Any) -> None:
        """Helper weights ready and fresh, the runner built (first split forward, or after
        a weight change or a release). `prefetch`: the prefetcher's state in this forward."""
        if self.runner is None:
            self.runner = SequenceRunner(self.split, self.transport, self.config.timeout_s)
        if self.clone_refusal is None:
            return  # ComfyUI loaded and patched the helper clones (`outer_sample_wrapper`)
        for k in range(1, len(self.devices)):
            weights = self.helper_weights.get(k)
            if weights is None:
                weights = self._new_helper_weights(k, seq_len, prefetch)
                self.helper_weights[k] = weights
            weights.refresh(self.base_model, prefetch)

    def _new_helper_weights(self, k: int, seq_len: int, prefetch: Any) -> HelperWeights:
        device = self.devices[k]
        probe = HelperWeights(device, self.blocks, REPLICA)
        total = probe.total_bytes
        memory = sizing.sequence_memory(seq_len, self.split.head_counts,
                                        row_weights=self.split.row_weights,
                                        chunk_heads=self.split.chunk_heads_for(seq_len))
        reserve = memory[k].peak + GIB
        if self.config.helper_weights == "auto" and device.type == "cuda":
            _ask_comfy_to_free(device, total + reserve)
        mode, reason = choose_mode(self.config.helper_weights, device, total, reserve,
                                   _free_bytes)
        self.weights_reason = f"{device}: {reason}"
        if mode == REPLICA:
            return probe
        # the prefetcher's pinned-host budget, when it runs in this forward
        budget = getattr(prefetch, "pinned_budget_bytes", None)
        return HelperWeights(device, self.blocks, STREAM, lookahead=self.config.lookahead,
                             pinned_budget_bytes=budget)

    def _streamed_block_bytes(self) -> int:
        streamed = [w for w in self.helper_weights.values() if w.mode == STREAM]
        if not streamed:
            return 0
        return max(weights.weights[0].nbytes for weights in streamed)

    # ------------------------------------------------------------------ release
    def release(self) -> None:
        """Free the helpers' weights, the links and their buffers (rebuilt when next needed)."""
        for weights in self.helper_weights.values():
            weights.close()
        self.helper_weights = {}
        if self.runner is not None:
            self.runner.close()
        self.runner = None

    def recover(self, failure: BaseException, seq_len: int) -> None:
        """After a helper failure: wait for what was queued, free everything, remember S."""
        for device in self.devices:
            if device.type == "cuda":
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize(device)
        self.failed_lengths.add(seq_len)
        self.release()
        self.steps["fallback"] += 1
        warn_once(f"sequence parallel helper failed: {type(failure).__name__}: {failure}; this "
                  f"step runs on {self.devices[0]}, and steps of {seq_len:,} tokens stay there")

    def _drain(self) -> None:
        for device in dict.fromkeys(self.devices):
            if device.type == "cuda":
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize(device)


def _free_bytes(device: torch.device) -> int | None:
    # ComfyUI's count inside ComfyUI (DynamicVRAM's evictable memory included), torch's outside
    return free_vram_bytes(device)


def _ask_comfy_to_free(device: torch.device, nbytes: int) -> None:
    """Let ComfyUI unload what it keeps on the helper (the text encoder) to make room."""
    comfy_clones.ask_to_free(device, nbytes)  # advisory: our own check follows
