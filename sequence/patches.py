"""The ComfyUI seam of the mode: `apply_sequence_parallel(model_patcher, config)`.

Installs, on a clone of the patcher, through the seam (`comfy_seam.protocol`, feature
"sequence", with the `SequenceParallel` as its state, in its place in the protocol's ORDER):
- a `("dit", "double_block", i)` replace patch per DiT block, chaining a patch already there.
  Each GPU runs upstream's own block on its share of the rows (`runner.py`, by the split plan
  `plan.SPLIT_PLAN`): the root through the patch's `original_block`, each helper on its
  ComfyUI-managed clone of the model (`helpers.py`). The residual stream stays split over the
  GPUs across the whole block loop: the first patch scatters the rows, each later patch
  recognises the tensor the previous one returned (the model loop hands it straight on) and
  continues, the last one gathers. Anything else that could see the residual stream makes us
  gather first and scatter again after: a foreign patch chained inside ours, one wrapped around
  ours, or a block without our patch. A link the seam knows as transparent (`protocol.link_info`:
  our prefetcher's, which only brackets the block with its weight copies) keeps the split.
- a DIFFUSION_MODEL wrapper: the root GPU current for the forward, the per-forward state, and
  the fallback: a helper failure (out of memory, a runtime error) re-runs that step on one GPU,
  with one warning.
- an OUTER_SAMPLE wrapper (`helpers.py`): the helpers' clones handed to ComfyUI before it
  prepares sampling, unloaded after (unless `keep_weights`); an ON_DETACH callback frees our
  buffers when ComfyUI unloads the model.

Per forward the mode is decided at the first block, from the packed length S (`policy.decide`):
"sequence" when every row share stays inside the exact range and the predicted block time beats
one GPU and Dual-Sage; "heads" (Dual-Sage, when it is applied too); or "off". The choice is
written to `transformer_options[PARALLEL_KEY]`, which Dual-Sage's override honours.

What the mode asks the other features, through the seam only: `protocol.find(options,
"dual_sage")`, Dual-Sage's state, of which it reads `.plan` (its `counts_for(heads)` and
`.heads`: the head split it would run) and `.min_tokens` (the shortest call it shards);
`protocol.find(options, "prefetch")`, the prefetcher's state, handed to the pack's own helper
binding (its host copies, re-registrations and `pinned_budget_bytes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam import clones as comfy_clones
from ..comfy_seam import names, protocol
from ..comfy_seam.devices import gpu_count, root_device
from ..comfy_seam.h3 import forward_options, in_training, weight_format, wrapped_module
from ..comfy_seam.memory import is_dynamic
from ..common import exact_rows
from ..common.formats import (
    block_adapter_ranks,
    device_name,
    is_nvidia,
    linear_shape,
    skipped_adapter_note,
)
from ..exchange.mode import PARALLEL_KEY, ParallelMode
from ..exchange.transport import TransportMode, resolve
from . import plan, policy, status
from .cfg_groups import CfgGroups, group_config
from .config import SequenceParallelConfig
from .helpers import HelperLifecycle
from .runner import SequenceRunner, SplitState, device_current
from .weights import HelperWeights

log = logging.getLogger(__name__)
FEATURE = "sequence"


@dataclass
class _Forward:
    """One DiT forward's state."""

    options: dict
    forced: ParallelMode | None = None
    mode: ParallelMode | None = None
    reason: str = ""
    split: SplitState | None = None
    foreign_outside: frozenset[int] = frozenset()
    seq_len: int = 0


class SequenceParallel(HelperLifecycle):
    """The mode's state for one patched model: split, runner, helper weights, last decisions."""

    def __init__(self, diffusion_model: torch.nn.Module, base_model: Any,
                 devices: list[torch.device], config: SequenceParallelConfig,
                 dynamic_vram: bool = False, clone_refusal: str | None = None):
        self.diffusion_model = diffusion_model
        self.dynamic_vram = dynamic_vram
        # None: each helper is a ComfyUI-managed clone; else why we bind the weights ourselves
        self.clone_refusal = clone_refusal
        self.bases: dict[int, Any] = {}  # helper index -> its deepclone (kept for the model)
        self.clones: dict[int, Any] | None = None  # this sampling run's matched clones
        self.left_off: list[str] = []  # root object patches the helper clones run without
        self.base_model = base_model
        self.config = config
        self.blocks = list(diffusion_model.blocks)
        heads = getattr(getattr(self.blocks[0], "attn", None), "heads", config.heads)
        self.transport = config.transport
        self.modes = {resolve(self.transport, devices[0], d).value for d in devices[1:]}
        self.split = policy.build_split(devices, int(heads), config,
                                        host_relay=TransportMode.HOST.value in self.modes)
        self.runner: SequenceRunner | None = None
        self.helper_weights: dict[int, HelperWeights] = {}
        self.weights_reason = "decided at the first split step"
        self.failed_lengths: set[int] = set()
        self.decisions: dict[int, policy.Decision] = {}
        self.forward: _Forward | None = None
        self.steps = {"sequence": 0, "heads": 0, "off": 0, "fallback": 0}
        self.blocks_run = 0  # blocks run split, over the model's life (runners come and go)
        self.notes: dict[str, None] = {}  # run-time refusals the status line names
        self._floors: dict[tuple, tuple[int | None, str, int | None]] = {}
        self._group_patches: dict[tuple[int, int], Callable] = {}
        self.cfg = CfgGroups(self._make_group)  # the groups beside ComfyUI's CFG Split

    @property
    def host_relay(self) -> bool:
        return "host" in self.modes

    def _make_group(self, devices: list[torch.device], diffusion_model: torch.nn.Module,
                    base_model: Any) -> SequenceParallel:
        """One group beside CFG Split: the mode on `devices`, led by that cond's copy."""
        config = group_config(self.config, list(self.devices), devices)
        return SequenceParallel(diffusion_model, base_model, devices, config,
                                dynamic_vram=self.dynamic_vram, clone_refusal=self.clone_refusal)

    def detach_model(self) -> None:
        """A group after its run: no reference left to the model it ran (CFG Split's copy)."""
        self.diffusion_model = self.base_model = None
        self.blocks = []
        self.forward = None
        self._group_patches = {}

    def release_all(self) -> None:
        """Everything the mode holds on the helpers, its groups' too (ComfyUI unloads it)."""
        self.release()
        self.cfg.release()

    # ------------------------------------------------------------------ facts for the policy
    def gemm_devices(self) -> list[policy.GemmDevice]:
        return [policy.GemmDevice(device_name(d), d.type != "cpu", is_nvidia(d))
                for d in dict.fromkeys(self.devices)]

    def weight_formats(self) -> policy.Formats:
        """Each block linear's weight formats over the blocks (`comfy_seam.h3.weight_format`)."""
        return tuple((name, tuple(sorted({weight_format(_linear(b, name)) for b in self.blocks})))
                     for name in exact_rows.LINEARS)

    def share_floor(self, dtype: torch.dtype) -> tuple[int | None, str, int | None]:
        """`policy.share_floor` for the blocks' formats and the on-activation adapters that
        run on them now (bypass adapters are injected at load: looked up each time)."""
        found: dict[str, set[int]] = {name: set() for name in exact_rows.LINEARS}
        for block in self.blocks:
            for name, ranks_of in block_adapter_ranks(block).items():
                found[name].update(ranks_of)
        skipped = skipped_adapter_note(self.blocks[0])
        if skipped:
            self._note(skipped)
        ranks = tuple((name, tuple(sorted(found[name]))) for name in exact_rows.LINEARS)
        formats = self.weight_formats()
        key = (ranks, formats, dtype)
        if key not in self._floors:
            shapes = {name: linear_shape(_linear(self.blocks[0], name))
                      for name in exact_rows.LINEARS}
            self._floors[key] = policy.share_floor(self.gemm_devices(), ranks, formats, shapes,
                                                   str(dtype).removeprefix("torch."))
        return self._floors[key]

    def _refusal(self, seq_len: int, dtype: torch.dtype) -> str | None:
        floor, why, base = self.share_floor(dtype)
        refusal = self.split.refusal(seq_len, floor, why, base)
        note = policy.refusal_note(self.split, seq_len, refusal, floor)
        if note is not None:
            self._note(note)
        if refusal is None and seq_len in self.failed_lengths:
            refusal = "a helper failed at this length before"
        if refusal is None and self.clone_refusal is None and self.clones is None:
            refusal = ("the helper clones are loaded by ComfyUI's sampler, and this forward "
                       "ran outside sampling")
        return refusal

    def decide(self, seq_len: int, options: dict, forced: ParallelMode | None,
               dtype: torch.dtype = torch.bfloat16) -> policy.Decision:
        requested = forced or self.config.parallel
        dual_sage = protocol.find(options, "dual_sage")
        heads_plan = getattr(dual_sage, "plan", None)
        heads_ok = heads_plan is not None and seq_len >= getattr(dual_sage, "min_tokens", 0)
        refusal = None
        # the floor is looked up (and noted) only where the split is a candidate
        if requested is not ParallelMode.OFF and not (self.dynamic_vram and
                                                      self.clone_refusal is not None):
            refusal = self._refusal(seq_len, dtype)
        facts = policy.Facts(
            seq_len=seq_len, requested=requested, forced=forced is not None, heads_ok=heads_ok,
            heads_counts=heads_plan.counts_for(heads_plan.heads) if heads_ok else None,
            clone_refusal=self.clone_refusal, dynamic_vram=self.dynamic_vram, refusal=refusal,
            speeds=policy.speeds_of(self.config, len(self.devices)),
            link=policy.link_of(self.config, self.host_relay),
            streamed_block_bytes=self._streamed_block_bytes() if refusal is None else 0,
            margin=self.config.margin)
        return policy.decide(facts, self.split)

    # ------------------------------------------------------------------ per forward
    def begin_forward(self, options: dict, forced: ParallelMode | None = None) -> _Forward:
        forward = _Forward(options, forced=forced)
        forward.foreign_outside = frozenset(self._foreign_outside(options))
        self.forward = forward
        return forward

    def _ours(self, patch: Any) -> bool:
        info = protocol.link_info(patch)
        return info is not None and info.feature == FEATURE and info.state is self

    def _foreign_outside(self, options: dict) -> set[int]:
        """Blocks whose outermost patch chain is not ours (or transparent down to ours)."""
        out = set()
        for i in range(len(self.blocks)):
            patch = protocol.block_patch_at(options, i)
            while patch is not None and not self._ours(patch):
                info = protocol.link_info(patch)
                if info is None or not info.transparent:
                    out.add(i)
                    break
                patch = info.previous
            if patch is None:
                out.add(i)
        return out

    def _note(self, text: str) -> None:
        """A run-time refusal the status line names (and the log, once)."""
        if text in self.notes:
            return
        self.notes[text] = None
        status.warn_once(text)  # the status line reads the notes live (`record_status`)

    def status(self) -> str:
        line = status.status_line(self)
        words = self.cfg.words()
        return f"{line}; {words}" if words else line

    def choose_for(self, forward: _Forward, seq_len: int,
                   dtype: torch.dtype = torch.bfloat16) -> ParallelMode:
        if forward.mode is None:
            decision = self.decide(seq_len, forward.options, forward.forced, dtype)
            if forward.foreign_outside and decision.mode is ParallelMode.SEQUENCE:
                first = min(forward.foreign_outside)
                decision.reason += (f"; block {first} is patched outside the sequence mode, so "
                                    "the rows are gathered around it")
            forward.mode, forward.reason, forward.seq_len = decision.mode, decision.reason, seq_len
            previous = self.decisions.get(seq_len)
            if previous is None or previous.mode is not decision.mode:
                log.info("parallel at %d tokens: %s (%s)", seq_len, decision.mode.value,
                         decision.reason)
            self.decisions[seq_len] = decision
            forward.options[PARALLEL_KEY] = decision.mode.value
            self.steps[decision.mode.value] += 1
            if decision.mode is ParallelMode.SEQUENCE:
                self._prepare(seq_len, protocol.find(forward.options, "prefetch"))
        return forward.mode

    # ------------------------------------------------------------------ patches
    def block_patch(self, index: int, previous: Callable | None) -> Callable:
        last = index == len(self.blocks) - 1
        inside = protocol.link_info(previous)
        transparent_inside = previous is None or (inside is not None and inside.transparent)

        def patch(args: dict, extra: dict) -> dict:
            forward = self.forward
            options = args.get(plan.OPTIONS)
            if forward is None or forward.options is not options:
                group = self.cfg.owner_of(options)  # a cond's group beside CFG Split
                if group is not None:
                    return group.group_patch(index, previous)(args, extra)
                return _call(previous, args, extra)  # outside our wrapper: plain block
            h = args[plan.RESIDUAL]
            if forward.mode is None:
                self.choose_for(forward, h.shape[0], h.dtype)
            if forward.mode is not ParallelMode.SEQUENCE or not plan.splittable(args) or \
                    in_training(self.blocks[index]):
                self._gather_into(forward)
                return _call(previous, args, extra)

            original = extra[names.ORIGINAL_BLOCK]

            def run(a: dict) -> dict:
                return {plan.OUTPUT: self._run(forward, index, a, original, last)}

            if transparent_inside:
                return _call(previous, args, {**extra, names.ORIGINAL_BLOCK: run})
            # a foreign patch inside ours may read the residual stream: hand it the whole one
            self._gather_into(forward)
            forward.split = None
            return previous(args, {**extra, names.ORIGINAL_BLOCK: run})

        return patch

    def group_patch(self, index: int, previous: Callable | None) -> Callable:
        """This group's patch of block `index` over the chain the root's options carry."""
        key = (index, id(previous))
        patch = self._group_patches.get(key)
        if patch is None:
            patch = self._group_patches[key] = self.block_patch(index, previous)
        return patch

    def _gather_into(self, forward: _Forward) -> None:
        if forward.split is not None and self.runner is not None:
            try:
                self.runner.gather(forward.split)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                raise SequenceFailure(forward.seq_len) from exc
        forward.split = None

    def _run(self, forward: _Forward, index: int, args: dict, original: Callable,
             last: bool) -> torch.Tensor:
        h_SC = args[plan.RESIDUAL]
        inputs = plan.inputs_of(args)
        runner = self.runner
        assert runner is not None
        try:
            state = forward.split
            if state is None or not state.owns(h_SC, inputs):
                state = runner.scatter({key: args[key] for key in plan.SPLIT_PLAN})
                forward.split = state
            calls, blocks = [_root_call(original, args)], [self.blocks[index]]
            for k in range(1, len(self.devices)):
                call, block = self._helper_call(k, index)
                calls.append(call)
                blocks.append(block)
            runner.run_block(state, calls, args[plan.OPTIONS], blocks)
            self.blocks_run += 1
            # whoever sees h next must see all of it: the model after the last block, a foreign
            # patch around this block or the next one
            outside = forward.foreign_outside
            if last or index in outside or index + 1 in outside:
                runner.gather(state)
                forward.split = None
        except (torch.OutOfMemoryError, RuntimeError, TimeoutError) as exc:
            raise SequenceFailure(forward.seq_len) from exc
        except BaseException:
            # an interrupt or a foreign error: nothing of this forward is reused, and what the
            # shares queued must finish before their buffers are freed or reused
            forward.split = None
            self._drain()
            raise
        return h_SC

    # ------------------------------------------------------------------ wrappers
    def diffusion_model_wrapper(self) -> Callable:
        def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
            options = forward_options(args, kwargs)
            if options is None:
                return executor(*args, **kwargs)
            if self.cfg.active:  # beside CFG Split: the group of the copy this forward runs
                group = self.cfg.for_model(wrapped_module(executor))
                if group is None:
                    return executor(*args, **kwargs)
                return group.run_forward(executor, options, args, kwargs)
            return self.run_forward(executor, options, args, kwargs)

        return wrapper

    def run_forward(self, executor: Callable, options: dict, args: tuple, kwargs: dict) -> Any:
        """One DiT forward on this mode's devices (a helper failure: again on the root)."""
        with device_current(self.devices[0]):
            try:
                self.begin_forward(options)
                try:
                    return executor(*args, **kwargs)
                except SequenceFailure as failure:
                    self.recover(failure.__cause__ or failure, failure.seq_len)
                    self.begin_forward(options, forced=ParallelMode.OFF)
                    return executor(*args, **kwargs)
            finally:
                self.forward = None
                options.pop(PARALLEL_KEY, None)


class SequenceFailure(Exception):
    """A helper could not take its share; the cause is chained. Carries the length."""

    def __init__(self, seq_len: int):
        super().__init__(f"sequence parallel failed at {seq_len} tokens")
        self.seq_len = seq_len


def _linear(block: torch.nn.Module, name: str) -> torch.nn.Module:
    return getattr(block.attn if name in ("qkv_proj", "out_proj") else block.mlp, name)


def _root_call(original: Callable, args: dict) -> Callable:
    """The root share's block call: the patch's `original_block` (upstream's block, with what
    ComfyUI or a transparent patch put around it) on the root's rows."""
    def call(share: dict, options: dict) -> torch.Tensor:
        return original({**args, **share, plan.OPTIONS: options})[plan.OUTPUT]
    return call


def _call(previous: Callable | None, args: dict, extra: dict) -> dict:
    if previous is not None:
        return previous(args, extra)
    return extra[names.ORIGINAL_BLOCK](args)


def _visible_gpus() -> int:
    return gpu_count()  # the GPUs ComfyUI uses (--cuda-device), not all torch sees


def apply_sequence_parallel(model_patcher: Any, config: SequenceParallelConfig) -> Any:
    """A clone of `model_patcher` whose DiT blocks run split over GPUs by token rows."""
    if not isinstance(config, SequenceParallelConfig):
        raise ValueError(f"config must be a SequenceParallelConfig, got {type(config).__name__}")
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    blocks = getattr(diffusion_model, "blocks", None)
    if not blocks:
        raise ValueError(f"{type(diffusion_model).__name__} has no DiT blocks; sequence parallel "
                         "needs a MiniMax H3 model")
    root = root_device(model_patcher)
    devices = policy.resolve_devices(root, config.helpers, _visible_gpus())
    # under DynamicVRAM the mode runs on ComfyUI-managed helper clones only (each its own VBARs,
    # LoRA at op time): the pack's own binding would copy each module's unpatched host weight
    # and the helper's linears would take ComfyUI's VBAR cast bound to the root
    mode = SequenceParallel(diffusion_model, model_patcher.model, devices, config,
                            dynamic_vram=is_dynamic(model_patcher),
                            clone_refusal=comfy_clones.clone_refusal(model_patcher))

    patched = model_patcher.clone()
    # each block's patch chains the one already there (a foreign patch, our prefetcher's)
    hooks = [protocol.block_patch(i, lambda previous, i=i: mode.block_patch(i, previous))
             for i in range(len(blocks))]
    protocol.install(
        patched, FEATURE, *hooks,
        protocol.wrapper(names.DIFFUSION_MODEL, mode.diffusion_model_wrapper()),
        protocol.wrapper(names.OUTER_SAMPLE, mode.outer_sample_wrapper()),
        protocol.callback(names.ON_DETACH, lambda *a, **k: mode.release_all()),
        state=mode)
    # live: run-time refusals show in the line as soon as they happen
    protocol.record_status(patched, FEATURE, mode.status(), live=mode.status)
    return patched


def get_sequence_parallel(model_patcher: Any) -> SequenceParallel | None:
    """The mode installed on a patcher (the seam's record of its state), if any."""
    mode = protocol.find(model_patcher, FEATURE)
    return mode if isinstance(mode, SequenceParallel) else None
