"""ComfyUI seam: `SequenceParallelConfig` and `apply_sequence_parallel(model_patcher, config)`.

Installs, on a clone of the patcher, through the seam (`comfy_seam.protocol`, feature
"sequence", in its place in the protocol's ORDER):
- a `("dit", "double_block", i)` replace patch per DiT block, chaining a patch already there.
  Each GPU runs upstream's own block on its share of the rows (`runner.py`): the root through
  the patch's `original_block`, each helper on its ComfyUI-managed clone of the model.
  The residual stream stays split over the GPUs across the whole block loop: the first patch
  scatters the rows, each later patch recognises the tensor the previous one returned (the model
  loop hands it straight on) and continues, the last one gathers. Anything else that could see
  the residual stream makes us gather first and scatter again after: a foreign patch chained
  inside ours, one wrapped around ours, or a block without our patch. Our own prefetcher's patch
  only brackets the block with its weight copies (it is marked transparent), so it keeps the split.
- a DIFFUSION_MODEL wrapper: the root GPU current for the forward, the per-forward state, and
  the fallback: a helper failure (out of memory, a runtime error) re-runs that step on one GPU,
  with one warning.
- an OUTER_SAMPLE wrapper: before ComfyUI prepares sampling, each helper's clone
  (`comfy_seam.clones`: made once with ComfyUI's `deepclone_multigpu`, then matched to this run's
  patcher: its LoRA patches, injections and hooks) is handed to ComfyUI as an additional model,
  so ComfyUI loads it on the helper GPU (legacy loader or DynamicVRAM) and patches it; after
  sampling the helpers are unloaded (unless `keep_weights`), so the helper GPU is free for the
  VAEs, the upscaler and the text encoder; a ModelPatcher ON_DETACH callback frees our buffers
  when ComfyUI unloads the model. Models ComfyUI cannot clone (no reload factory: the twin, a
  custom loader) get our own binding (`weights.py`), named in the status line.

Per forward the mode is decided at the first block, from the packed length S: "sequence" when
every row share stays inside the exact range and the predicted block time beats one GPU and
Dual-Sage; "heads" (Dual-Sage, when it is applied too); or "off". The choice is written to
`transformer_options[PARALLEL_KEY]`, which Dual-Sage's override honours.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..chunking.formats import (
    block_adapter_ranks,
    device_name,
    is_nvidia,
    linear_shape,
    skipped_adapter_note,
)
from ..comfy_seam import clones as comfy_clones
from ..comfy_seam import names, protocol
from ..comfy_seam.h3 import forward_options, sampled_patcher, weight_format
from ..comfy_seam.memory import free_vram_bytes, is_dynamic
from ..common import exact_rows
from ..common.devices import parse_devices, validate_devices
from ..common.geometry import HEADS
from ..exchange.mode import PARALLEL_KEY, ParallelMode
from ..exchange.transport import TransportMode, resolve
from . import sizing
from .runner import SequenceRunner, SplitState, device_current
from .split import SequenceSplit
from .threads import DEFAULT_TIMEOUT_S
from .weights import REPLICA, STREAM, HelperWeights, choose_mode

log = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_LINK = {TransportMode.PEER: 300.0, TransportMode.HOST: 25.0}
DYNAMIC_VRAM_OFF = "off: under DynamicVRAM the helper weights need ComfyUI-managed clones"
OUR_BINDING = "helper weights bound by the pack (ComfyUI cannot clone this model: {why})"
COMFY_CLONES = "helper weights: ComfyUI-managed clones (deepclone_multigpu, loaded by ComfyUI)"
_warned: set[str] = set()


def warn_once(message: str) -> None:
    key = message.split(":")[0]
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


@dataclass
class SequenceParallelConfig:
    """Token rows of every DiT block split over GPUs, heads exchanged around attention.

    parallel: "auto" (per forward the fastest of sequence / heads / one GPU by predicted time),
        "sequence" (whenever the exact range allows), "heads" (leave it to Dual-Sage), "off".
    helpers: helper devices ("cuda:0", ...) or None for every other visible GPU.
    split: "auto" (equal rows and heads) or relative throughputs "1.0:0.7" (root first).
    transport: "auto" (peer when possible), "peer" or "host" (pinned host relay).
    helper_weights: "auto" (a replica when it fits, else streamed), "replica" or "stream".
    chunk_heads: heads per attention call; None: 7 over peer copies, 4 through the host relay
        (`sizing.chunk_heads_for`), raised at short lengths (see `split.py`).
    min_rows: smallest row share (None: the measured exact range: 4096 rows on GPUs for plain
        weights, none for INT8 ConvRot on NVIDIA GPUs, `chunking.exact_rows`).
    keep_weights: keep the helpers' weights between sampling runs (faster, holds helper memory).
    timeout_s: how long a share waits for another before the block is aborted (a stuck GPU).
    gpu_speeds / link_gbps: the time model's inputs (the planner passes the profile's).
    """

    parallel: ParallelMode | str = ParallelMode.AUTO
    helpers: tuple[str, ...] | None = None
    split: str = "auto"
    transport: TransportMode | str = TransportMode.AUTO
    helper_weights: str = "auto"
    chunk_heads: int | None = None  # None: by transport (sizing.chunk_heads_for)
    min_rows: int | None = None
    lookahead: int = 2
    keep_weights: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    gpu_speeds: tuple[sizing.GPUSpeed, ...] | None = None
    link_gbps: float | None = None
    host_gbps: float = 25.0
    margin: float = sizing.DEFAULT_MARGIN
    heads: int = HEADS  # used when the model does not say
    note: str = ""  # appended to the status line (the plan's per-pass prediction)

    def __post_init__(self) -> None:
        self.parallel = ParallelMode.parse(self.parallel)
        self.transport = TransportMode.parse(self.transport)
        if self.helper_weights not in ("auto", REPLICA, STREAM):
            raise ValueError(f"helper_weights {self.helper_weights!r} is unknown; use 'auto', "
                             f"'{REPLICA}' or '{STREAM}'")
        if (self.chunk_heads is not None and self.chunk_heads < 1) or self.lookahead < 1:
            raise ValueError(f"chunk_heads={self.chunk_heads} and lookahead={self.lookahead} "
                             "must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")
        if self.min_rows is not None and self.min_rows < 1:
            raise ValueError(f"min_rows={self.min_rows} must be >= 1 (or None for the exact "
                             "range)")
        if self.helpers is not None:
            self.helpers = tuple(str(d) for d in self.helpers)


def config_from_plan(plan: Any, **overrides: Any) -> SequenceParallelConfig:
    """The planner's choice as a config: devices, row weights, link and GPU rates."""
    from ..planner.parallel import gpu_speed, link_speed  # the planner's own conversion

    parallel = plan.parallel
    profile = plan.profile
    order = [plan.root_device, *plan.helper_devices]
    quantized = bool(getattr(plan.request, "quantized_attention", False))
    # the attention kernel the plan was timed with (older plans: the quantized flag)
    kernel = getattr(getattr(plan, "attention", None), "kernel", None)
    speeds = tuple(gpu_speed(profile.gpus[i], kernel or quantized) for i in order)
    # the helper streams its DiT when the plan found no room for a replica in some pass (the
    # runtime's own "auto" looks at the first split step only, and keeps its choice)
    planned = {p.helper_weights for p in parallel.passes.values() if p.mode == "sequence"}
    link = link_speed(profile)
    values: dict[str, Any] = dict(
        parallel="auto" if parallel.requested in ("auto", "heads") else parallel.requested,
        helpers=tuple(f"cuda:{i}" for i in plan.helper_devices),
        split=":".join(f"{w:g}" for w in parallel.row_weights),
        transport=parallel.transport if parallel.transport in ("peer", "host") else "auto",
        gpu_speeds=speeds, link_gbps=link.gbps, host_gbps=link.host_gbps,
        helper_weights=STREAM if STREAM in planned else "auto",
        note="plan: " + ", ".join(f"{name.upper()} {p.mode} ({p.speedup:.2f}x predicted)"
                                  for name, p in parallel.passes.items()))
    values.update(overrides)
    return SequenceParallelConfig(**values)


def resolve_devices(root: torch.device, helpers: tuple[str, ...] | None) -> list[torch.device]:
    """Root first, then the helpers; ValueError for an unknown or repeated GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if helpers is None:
        found = [torch.device("cuda", i) for i in range(count)
                 if root.type != "cuda" or i != root.index]
    else:  # the parsing and checks Dual-Sage and the decode use
        found = list(parse_devices(",".join(helpers)) or ())
    if not found:
        raise ValueError(f"sequence parallel needs a helper GPU besides the root {root}; none "
                         "is visible (set helpers, or parallel 'off')")
    validate_devices(root, found)
    return [root, *found]


def _root_device(model_patcher: Any) -> torch.device:
    root = torch.device(model_patcher.load_device)
    if root.type == "cuda" and root.index is None:
        root = torch.device("cuda", torch.cuda.current_device())
    return root


def build_split(devices: list[torch.device], heads: int, config: SequenceParallelConfig,
                host_relay: bool = False) -> SequenceSplit:
    text = config.split.strip().lower()
    chunk_heads = config.chunk_heads or sizing.chunk_heads_for(host_relay)
    common = dict(chunk_heads=chunk_heads, min_rows=config.min_rows)
    if text in ("auto", ""):
        if config.gpu_speeds is not None and len(set(config.gpu_speeds)) > 1:
            weights = [s.matmul_tflops for s in config.gpu_speeds]
            return SequenceSplit.weighted(devices, heads, weights, **common)
        if heads % len(devices) == 0:
            return SequenceSplit.even(devices, heads, **common)
        return SequenceSplit.weighted(devices, heads, [1.0] * len(devices), **common)
    try:
        weights = [float(p) for p in text.replace(",", ":").split(":")]
    except ValueError:
        raise ValueError(f"split {config.split!r} is not a list of numbers; write it like "
                         "'1.0:0.7' (root first) or 'auto'") from None
    if len(weights) != len(devices):
        raise ValueError(f"split {config.split!r} has {len(weights)} entries for {len(devices)} "
                         "devices (root first, then each helper)")
    return SequenceSplit.weighted(devices, heads, weights, **common)


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


@dataclass
class _Decision:
    mode: ParallelMode
    reason: str
    predicted_ms: dict[str, float] = field(default_factory=dict)


class SequenceParallel:
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
        self.split = build_split(devices, int(heads), config,
                                 host_relay=TransportMode.HOST.value in self.modes)
        self.runner: SequenceRunner | None = None
        self.helper_weights: dict[int, HelperWeights] = {}
        self.weights_reason = "decided at the first split step"
        self.failed_lengths: set[int] = set()
        self.decisions: dict[int, _Decision] = {}
        self.forward: _Forward | None = None
        self.steps = {"sequence": 0, "heads": 0, "off": 0, "fallback": 0}
        self.blocks_run = 0  # blocks run split, over the model's life (runners come and go)
        self.notes: dict[str, None] = {}  # run-time refusals the status line names
        self.sinks: list[dict] = []  # status dicts the line was written to
        self._floors: dict[tuple, tuple[int | None, str]] = {}

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self.split.devices

    @property
    def host_relay(self) -> bool:
        return "host" in self.modes

    # ------------------------------------------------------------------ decisions
    def speeds(self) -> list[sizing.GPUSpeed]:
        if self.config.gpu_speeds is not None:
            return list(self.config.gpu_speeds)
        return [sizing.GPUSpeed()] * len(self.devices)

    def link(self) -> sizing.LinkSpeed:
        mode = TransportMode.HOST if self.host_relay else TransportMode.PEER
        gbps = self.config.link_gbps or DEFAULT_LINK[mode]
        return sizing.LinkSpeed(gbps=gbps, host_relay=self.host_relay,
                                host_gbps=self.config.host_gbps)

    def weight_formats(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each block linear's weight formats over the blocks (`comfy_seam.h3.weight_format`)."""
        return tuple((name, tuple(sorted({weight_format(_linear(b, name)) for b in self.blocks})))
                     for name in exact_rows.LINEARS)

    def share_floor(self, dtype: torch.dtype) -> tuple[int | None, str, int | None]:
        """(rows, why, base): the row floor the blocks' GEMMs need on every device, for their
        weight formats and the on-activation adapters that run on them now
        (`chunking.exact_rows`): rows 0 when nothing beyond the share floor, None when a GEMM
        has no known floor (`why` names it); base the formats' own share floor (None: the
        split's, 4,096 rows on GPUs; 1 for INT8 ConvRot)."""
        found: dict[str, set[int]] = {name: set() for name in exact_rows.LINEARS}
        for block in self.blocks:  # bypass adapters are injected at load: look each time
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
            dtype_name = str(dtype).removeprefix("torch.")
            floor, why, bases = 0, "", []
            for device in dict.fromkeys(self.devices):
                name = device_name(device)
                table = exact_rows.table_for(name, dtype_name)
                rule = exact_rows.PhaseRule.combine([
                    exact_rows.linear_rule(table, linear, *shapes[linear], dict(ranks)[linear],
                                           where=f"{name} {dtype_name}",
                                           gpu=device.type != "cpu", weight_format=fmt,
                                           nvidia=is_nvidia(device))
                    for linear, fmts in formats for fmt in fmts])
                if rule.floor is None:
                    floor, why = None, rule.why
                    break
                bases.append(rule.base)
                if rule.floor > floor:
                    adapted = any(rs for _, rs in ranks)
                    floor, why = rule.floor, ("the measured floor of the blocks' GEMMs"
                                              + (" with their on-activation adapters" if adapted
                                                 else "") + f" on {name}")
            base = None if floor is None or None in bases else max(bases, default=None)
            self._floors[key] = (floor, why, base)
        return self._floors[key]

    def decide(self, seq_len: int, options: dict, forced: ParallelMode | None,
               dtype: torch.dtype = torch.bfloat16) -> _Decision:
        requested = forced or self.config.parallel
        heads_call = _dual_sage_in(options)
        heads_ok = heads_call is not None and seq_len >= getattr(heads_call, "min_tokens", 0)
        if requested is ParallelMode.OFF:
            return _Decision(ParallelMode.OFF, "switched off" if forced is None else
                             "a helper failed at this length: one GPU")
        if self.dynamic_vram and self.clone_refusal is not None:
            return _Decision(ParallelMode.HEADS if heads_ok else ParallelMode.OFF,
                             DYNAMIC_VRAM_OFF.removeprefix("off: ") + f": {self.clone_refusal}")
        floor, why, base = self.share_floor(dtype)
        refusal = self.split.refusal(seq_len, floor, why, base)
        if refusal is not None and (floor is None or floor > self.split.exact_min_rows
                                    or not refusal.startswith(f"{seq_len:,} tokens")):
            self._note(f"sequence refused at {seq_len:,} tokens: {refusal}")
        if refusal is None and seq_len in self.failed_lengths:
            refusal = "a helper failed at this length before"
        if refusal is None and self.clone_refusal is None and self.clones is None:
            refusal = ("the helper clones are loaded by ComfyUI's sampler, and this forward "
                       "ran outside sampling")
        speeds, link = self.speeds(), self.link()
        times = {"off": sizing.one_gpu_block_ms(seq_len, speeds[0])}
        if refusal is None:
            streamed = self._streamed_block_bytes()
            times["sequence"] = sizing.sequence_block_ms(
                seq_len, speeds, self.split.head_counts, link,
                row_weights=self.split.row_weights,
                chunk_heads=self.split.chunk_heads_for(seq_len), streamed_block_bytes=streamed)
        if heads_ok:
            plan = heads_call.plan
            counts = plan.counts_for(plan.heads)
            times["heads"] = sizing.heads_block_ms(seq_len, speeds[:len(counts)] if
                                                   len(speeds) >= len(counts) else
                                                   [speeds[0]] * len(counts), counts, link)
        gain = {m: times["off"] / t for m, t in times.items()}
        if requested is ParallelMode.SEQUENCE:
            if refusal is None:
                return _Decision(ParallelMode.SEQUENCE, "forced", times)
            mode = ParallelMode.HEADS if heads_ok else ParallelMode.OFF
            return _Decision(mode, f"sequence refused: {refusal}", times)
        if requested is ParallelMode.HEADS:
            return _Decision(ParallelMode.HEADS if heads_ok else ParallelMode.OFF,
                             "forced" if heads_ok else "Dual-Sage is not applied or the call is "
                             "below its min_tokens", times)
        best = min(times, key=times.get)  # type: ignore[arg-type]
        if best != "off" and gain[best] < self.config.margin:
            best = "off"
        why = ", ".join(f"{m} {t:.1f} ms" for m, t in sorted(times.items()))
        reason = f"predicted per block at {seq_len:,} tokens: {why}"
        if refusal is not None:
            reason += f"; sequence refused: {refusal}"
        return _Decision(ParallelMode(best), reason, times)

    def _streamed_block_bytes(self) -> int:
        streamed = [w for w in self.helper_weights.values() if w.mode == STREAM]
        if not streamed:
            return 0
        return max(weights.weights[0].nbytes for weights in streamed)

    # ------------------------------------------------------------------ per forward
    def begin_forward(self, options: dict, forced: ParallelMode | None = None) -> _Forward:
        forward = _Forward(options, forced=forced)
        forward.foreign_outside = frozenset(self._foreign_outside(options))
        self.forward = forward
        return forward

    def _foreign_outside(self, options: dict) -> set[int]:
        """Blocks whose outermost patch chain is not ours (or transparent down to ours)."""
        out = set()
        for i in range(len(self.blocks)):
            patch = protocol.block_patch_at(options, i)
            while patch is not None and getattr(patch, "h3_multigpu_sequence", None) is not self:
                if not getattr(patch, "h3_multigpu_transparent", False):
                    out.add(i)
                    break
                patch = getattr(patch, "h3_multigpu_previous", None)
            if patch is None:
                out.add(i)
        return out

    def _note(self, text: str) -> None:
        """A run-time refusal the status line names (and the log, once)."""
        if text in self.notes:
            return
        self.notes[text] = None
        warn_once(text)
        line = self.status()
        for sink in self.sinks:
            sink["sequence"] = line

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
                self._prepare(seq_len, forward.options)
        return forward.mode

    def _prepare(self, seq_len: int, options: dict) -> None:
        """Helper weights ready and fresh, the runner built (first split forward, or after
        a weight change or a release)."""
        if self.runner is None:
            self.runner = SequenceRunner(self.split, self.transport, self.config.timeout_s)
        if self.clone_refusal is None:
            return  # ComfyUI loaded and patched the helper clones (`outer_sample_wrapper`)
        prefetch = _prefetch_in(options)
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
        budget = getattr(prefetch, "pinned_budget_bytes", None)
        return HelperWeights(device, self.blocks, STREAM, lookahead=self.config.lookahead,
                             pinned_budget_bytes=budget)

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

    # ------------------------------------------------------------------ patches
    def block_patch(self, index: int, previous: Callable | None) -> Callable:
        last = index == len(self.blocks) - 1
        transparent_inside = previous is None or getattr(previous, "h3_multigpu_transparent",
                                                         False)

        def patch(args: dict, extra: dict) -> dict:
            forward = self.forward
            options = args.get(names.TRANSFORMER_OPTIONS)
            if forward is None or forward.options is not options:
                return _call(previous, args, extra)  # outside our wrapper: plain block
            if forward.mode is None:
                self.choose_for(forward, args["img"].shape[0], args["img"].dtype)
            if forward.mode is not ParallelMode.SEQUENCE or not _decomposable(args) or \
                    comfy_clones.in_training(self.blocks[index]):
                self._gather_into(forward)
                return _call(previous, args, extra)

            original = extra["original_block"]

            def run(a: dict) -> dict:
                return {"img": self._run(forward, index, a, original, last)}

            if transparent_inside:
                return _call(previous, args, {**extra, "original_block": run})
            # a foreign patch inside ours may read the residual stream: hand it the whole one
            self._gather_into(forward)
            forward.split = None
            return previous(args, {**extra, "original_block": run})

        patch.h3_multigpu_sequence = self  # type: ignore[attr-defined]
        patch.h3_multigpu_previous = previous  # type: ignore[attr-defined]
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
        h_SC = args["img"]
        t_emb, rope, segments = args["t_emb"], args["rope_freqs"], args["mod_segments"]
        runner = self.runner
        assert runner is not None
        try:
            state = forward.split
            if state is None or not state.owns(h_SC, t_emb, rope, segments):
                state = runner.scatter(h_SC, t_emb, rope, segments)
                state.inputs = (id(t_emb), id(rope), id(segments))
                forward.split = state
            calls, blocks = [_root_call(original, args)], [self.blocks[index]]
            for k in range(1, len(self.devices)):
                call, block = self._helper_call(k, index)
                calls.append(call)
                blocks.append(block)
            runner.run_block(state, calls, args[names.TRANSFORMER_OPTIONS], blocks)
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

    def _helper_call(self, k: int, index: int) -> tuple[Callable, torch.nn.Module]:
        """Share k's block call: upstream's block of its ComfyUI clone, or our bound copy."""
        if self.clone_refusal is None:
            assert self.clones is not None
            block = comfy_clones.diffusion_model(self.clones[k]).blocks[index]

            def clone_call(x, t_emb, segments, rope, options):
                return block(x, t_emb, segments, rope, transformer_options=options)

            return clone_call, block
        weights = self.helper_weights[k]

        def copy_call(x, t_emb, segments, rope, options):
            weights.begin(index)  # streamed: its slot filled (helper stream waits for it)
            with weights.use(index) as module:
                out = module(x, t_emb, segments, rope, transformer_options=options)
            weights.end(index)
            return out

        return copy_call, self.blocks[index]

    def _drain(self) -> None:
        for device in dict.fromkeys(self.devices):
            if device.type == "cuda":
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize(device)

    # ------------------------------------------------------------------ wrappers
    def diffusion_model_wrapper(self) -> Callable:
        def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
            options = forward_options(args, kwargs)
            if options is None:
                return executor(*args, **kwargs)
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

        wrapper.h3_multigpu_sequence = self  # type: ignore[attr-defined]
        return wrapper

    def outer_sample_wrapper(self) -> Callable:
        def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
            root = sampled_patcher(executor)
            clones = self.match_clones(root)
            try:
                return executor(*args, **kwargs)
            finally:
                for clone in clones:
                    comfy_clones.cleanup(clone)
                self.clones = None
                if not self.config.keep_weights:
                    self.release()
                    for clone in clones:
                        comfy_clones.unload(clone)

        return wrapper

    def match_clones(self, root: Any) -> list[Any]:
        """Before ComfyUI prepares sampling: each helper's clone matched to `root` (this run's
        patcher) and handed to ComfyUI as an additional model, which loads and patches it."""
        if self.clone_refusal is not None or root is None or \
                self.config.parallel is ParallelMode.OFF:
            return []
        clones, left_off = {}, set()
        for k in range(1, len(self.devices)):
            base = self.bases.get(k)
            if base is None:
                base = comfy_clones.make_clone(root, self.devices[k])
                self.bases[k] = base
            clones[k], missing = comfy_clones.match_clone(root, base)
            left_off.update(missing)
        comfy_clones.set_clones(root, list(clones.values()))
        for clone in clones.values():
            comfy_clones.pre_run(clone)
        if left_off:
            self._note(f"the helper clones run without {len(left_off)} object patch(es) of "
                       f"the root's blocks that cannot move to another model "
                       f"({sorted(left_off)[0]}, ...): the helper shares run upstream's plain "
                       "block there")
        self.clones = clones
        return list(clones.values())

    def weights_words(self) -> str:
        if self.clone_refusal is None:
            words = COMFY_CLONES
            if self.dynamic_vram:
                words += ", under DynamicVRAM"
            return words
        return OUR_BINDING.format(why=self.clone_refusal) + f": {self.config.helper_weights}"

    def status(self) -> str:
        if self.dynamic_vram and self.clone_refusal is not None:
            return (f"{DYNAMIC_VRAM_OFF}, and {self.clone_refusal}; each step runs on "
                    "Dual-Sage's heads where it is applied, else on one GPU")
        split = self.split
        helpers = ", ".join(str(d) for d in self.devices[1:])
        rows = ":".join(f"{w:g}" for w in split.row_weights)
        heads = "+".join(str(c) for c in split.head_counts)
        return (f"sequence parallel {self.config.parallel.value}: root {self.devices[0]}, "
                f"helpers {helpers}; rows {rows}, heads {heads} in chunks of >= "
                f"{split.chunk_heads_for(1 << 30)}; transport {'/'.join(sorted(self.modes))}; "
                f"{self.weights_words()}; {self._exact_words()}; mode "
                f"chosen per step from the token count"
                + (f"; {self.config.note}" if self.config.note else "")
                + "".join(f"; {note}" for note in self.notes))


    def _exact_words(self) -> str:
        """What the status claims about exactness, for the blocks' weight formats."""
        rule = exact_rows.PhaseRule.combine([
            exact_rows.linear_rule(None, name, 1, 1, (), where="", gpu=device.type != "cpu",
                                   weight_format=fmt, nvidia=is_nvidia(device))
            for device in dict.fromkeys(self.devices) for name, fmts in self.weight_formats()
            for fmt in fmts])
        if rule.floor is None:
            return f"exact only where known: {rule.why}, so steps run another way"
        if rule.base == 1:
            rows = "row shares of any size (INT8 ConvRot weights)"
        else:
            rows = f"row shares >= {self.split.exact_min_rows:,}"
        return (f"exact ({rows}, more with on-activation LoRA; shorter steps run another way)")


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
    def call(x, t_emb, segments, rope, options):
        return original({**args, "img": x, "t_emb": t_emb, "mod_segments": segments,
                         "rope_freqs": rope, names.TRANSFORMER_OPTIONS: options})["img"]
    return call


def _call(previous: Callable | None, args: dict, extra: dict) -> dict:
    if previous is not None:
        return previous(args, extra)
    return extra["original_block"](args)


def _decomposable(args: dict) -> bool:
    """The block call the mode can split: the block's own attention, RoPE present, inference."""
    if args.get("attention") is not None or args.get("rope_freqs") is None:
        return False
    return True


def _dual_sage_in(options: dict) -> Any:
    """Dual-Sage's sharded attention when its override is in the chain, else None."""
    override = protocol.override_of(options)
    seen = 0
    while override is not None and seen < 8:
        sharded = getattr(override, "sharded", None)
        if sharded is not None and hasattr(sharded, "plan"):
            return sharded
        override = getattr(override, "previous", None)
        seen += 1
    return None


def _prefetch_in(options: dict) -> Any:
    """Our prefetcher's state when its DIFFUSION_MODEL wrapper is in this forward's options."""
    for functions in protocol.forward_wrappers(options, names.DIFFUSION_MODEL).values():
        for fn in functions:
            prefetch = getattr(fn, "block_prefetch", None)
            if prefetch is not None:
                return prefetch
    return None


def _free_bytes(device: torch.device) -> int | None:
    # ComfyUI's count inside ComfyUI (DynamicVRAM's evictable memory included), torch's outside
    return free_vram_bytes(device)


def _ask_comfy_to_free(device: torch.device, nbytes: int) -> None:
    """Let ComfyUI unload what it keeps on the helper (the text encoder) to make room."""
    comfy_clones.ask_to_free(device, nbytes)  # advisory: our own check follows


def apply_sequence_parallel(model_patcher: Any, config: SequenceParallelConfig) -> Any:
    """A clone of `model_patcher` whose DiT blocks run split over GPUs by token rows."""
    if not isinstance(config, SequenceParallelConfig):
        raise ValueError(f"config must be a SequenceParallelConfig, got {type(config).__name__}")
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    blocks = getattr(diffusion_model, "blocks", None)
    if not blocks:
        raise ValueError(f"{type(diffusion_model).__name__} has no DiT blocks; sequence parallel "
                         "needs a MiniMax H3 model")
    root = _root_device(model_patcher)
    devices = resolve_devices(root, config.helpers)
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
        patched, "sequence", *hooks,
        protocol.wrapper(names.DIFFUSION_MODEL, mode.diffusion_model_wrapper()),
        protocol.wrapper(names.OUTER_SAMPLE, mode.outer_sample_wrapper()),
        protocol.callback(names.ON_DETACH, lambda *a, **k: mode.release()))
    # run-time refusals rewrite the line there
    mode.sinks.append(protocol.record_status(patched, "sequence", mode.status()))
    return patched
def get_sequence_parallel(model_patcher: Any) -> SequenceParallel | None:
    """The mode installed on a patcher (its block patches carry it), if any."""
    for patch in protocol.block_patches(model_patcher).values():
        while patch is not None:
            mode = getattr(patch, "h3_multigpu_sequence", None)
            if isinstance(mode, SequenceParallel):
                return mode
            patch = getattr(patch, "h3_multigpu_previous", None)
    return None
