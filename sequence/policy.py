"""The mode's decisions, pure: which devices, which split, the exactness floor, and per step the
mode by predicted time.

No ComfyUI, no streams, no allocation: each function takes the facts the mode gathered
(`patches.SequenceParallel` reads the model's blocks and the forward's options) and answers
from them, so every rule here is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common import exact_rows
from ..common.devices import helper_devices, validate_devices
from ..exchange.mode import ParallelMode
from ..exchange.transport import TransportMode
from . import sizing
from .config import SequenceParallelConfig
from .split import SequenceSplit

DEFAULT_LINK = {TransportMode.PEER: 300.0, TransportMode.HOST: 25.0}
DYNAMIC_VRAM_OFF = "off: under DynamicVRAM the helper weights need ComfyUI-managed clones"


# ---------------------------------------------------------------------- devices and split
def resolve_devices(root: torch.device, helpers: tuple[str, ...] | None,
                    visible: int) -> list[torch.device]:
    """Root first, then the helpers (None: every other of the `visible` GPUs); ValueError for
    an unknown or repeated GPU."""
    # the parsing and checks Dual-Sage and the decode use
    found = helper_devices(root, helpers, visible)
    if not found:
        raise ValueError(f"sequence parallel needs a helper GPU besides the root {root}; none "
                         "is visible (set helpers, or parallel 'off')")
    validate_devices(root, found)
    return [root, *found]


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


def speeds_of(config: SequenceParallelConfig, devices: int) -> list[sizing.GPUSpeed]:
    if config.gpu_speeds is not None:
        return list(config.gpu_speeds)
    return [sizing.GPUSpeed()] * devices


def link_of(config: SequenceParallelConfig, host_relay: bool) -> sizing.LinkSpeed:
    mode = TransportMode.HOST if host_relay else TransportMode.PEER
    gbps = config.link_gbps or DEFAULT_LINK[mode]
    return sizing.LinkSpeed(gbps=gbps, host_relay=host_relay, host_gbps=config.host_gbps)


# ---------------------------------------------------------------------- the exactness floor
@dataclass(frozen=True)
class GemmDevice:
    """What the floor rule needs of one device: its model name (`exact_rows.json`'s), GPU or
    not, NVIDIA or not."""

    name: str
    gpu: bool
    nvidia: bool


Ranks = tuple[tuple[str, tuple[int, ...]], ...]  # per linear: its on-activation adapter ranks
Formats = tuple[tuple[str, tuple[str, ...]], ...]  # per linear: its weight formats


def share_floor(devices: list[GemmDevice], ranks: Ranks, formats: Formats,
                shapes: dict[str, tuple[int, int]], dtype_name: str
                ) -> tuple[int | None, str, int | None]:
    """(rows, why, base): the row floor the blocks' GEMMs need on every device, for their
    weight formats and on-activation adapters (`common.exact_rows`): rows 0 when nothing beyond
    the share floor, None when a GEMM has no known floor (`why` names it); base the formats'
    own share floor (None: the split's, 4,096 rows on GPUs; 1 for INT8 ConvRot)."""
    floor: int | None = 0
    why, bases = "", []
    for device in devices:
        table = exact_rows.table_for(device.name, dtype_name)
        rule = exact_rows.PhaseRule.combine([
            exact_rows.linear_rule(table, linear, *shapes[linear], dict(ranks)[linear],
                                   where=f"{device.name} {dtype_name}", gpu=device.gpu,
                                   weight_format=fmt, nvidia=device.nvidia)
            for linear, fmts in formats for fmt in fmts])
        if rule.floor is None:
            floor, why = None, rule.why
            break
        bases.append(rule.base)
        if rule.floor > floor:
            adapted = any(rs for _, rs in ranks)
            floor, why = rule.floor, ("the measured floor of the blocks' GEMMs"
                                      + (" with their on-activation adapters" if adapted
                                         else "") + f" on {device.name}")
    base = None if floor is None or None in bases else max(bases, default=None)
    return floor, why, base


def format_rule(devices: list[GemmDevice], formats: Formats) -> exact_rows.PhaseRule:
    """The weight formats' own rule on these devices (no table, no adapters): what the status
    claims about exactness."""
    return exact_rows.PhaseRule.combine([
        exact_rows.linear_rule(None, name, 1, 1, (), where="", gpu=device.gpu,
                               weight_format=fmt, nvidia=device.nvidia)
        for device in devices for name, fmts in formats for fmt in fmts])


# ---------------------------------------------------------------------- the time decision
@dataclass
class Decision:
    mode: ParallelMode
    reason: str
    predicted_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Facts:
    """What one step's decision depends on, gathered by the mode at the first block."""

    seq_len: int
    requested: ParallelMode
    forced: bool  # the request is a fallback's (one GPU after a helper failed)
    heads_ok: bool  # Dual-Sage is applied and this length reaches its min_tokens
    heads_counts: tuple[int, ...] | None  # Dual-Sage's per-device head counts (heads_ok)
    clone_refusal: str | None
    dynamic_vram: bool
    refusal: str | None  # why the split is not exact or cannot run here (None: it can)
    speeds: list[sizing.GPUSpeed]
    link: sizing.LinkSpeed
    streamed_block_bytes: int
    margin: float


def refusal_note(split: SequenceSplit, seq_len: int, refusal: str | None, floor: int | None
                 ) -> str | None:
    """The run-time refusal the status line names, when it is more than a short step."""
    if refusal is not None and (floor is None or floor > split.exact_min_rows
                                or not refusal.startswith(f"{seq_len:,} tokens")):
        return f"sequence refused at {seq_len:,} tokens: {refusal}"
    return None


def decide(facts: Facts, split: SequenceSplit) -> Decision:
    """The step's mode: forced, or the fastest predicted per block (by `margin` over one GPU)."""
    requested, seq_len, heads_ok = facts.requested, facts.seq_len, facts.heads_ok
    if requested is ParallelMode.OFF:
        return Decision(ParallelMode.OFF, "a helper failed at this length: one GPU"
                        if facts.forced else "switched off")
    if facts.dynamic_vram and facts.clone_refusal is not None:
        return Decision(ParallelMode.HEADS if heads_ok else ParallelMode.OFF,
                        DYNAMIC_VRAM_OFF.removeprefix("off: ") + f": {facts.clone_refusal}")
    refusal, speeds, link = facts.refusal, facts.speeds, facts.link
    times = {"off": sizing.one_gpu_block_ms(seq_len, speeds[0])}
    if refusal is None:
        times["sequence"] = sizing.sequence_block_ms(
            seq_len, speeds, split.head_counts, link, row_weights=split.row_weights,
            chunk_heads=split.chunk_heads_for(seq_len),
            streamed_block_bytes=facts.streamed_block_bytes)
    if heads_ok:
        counts = facts.heads_counts or ()
        times["heads"] = sizing.heads_block_ms(seq_len, speeds[:len(counts)] if
                                               len(speeds) >= len(counts) else
                                               [speeds[0]] * len(counts), counts, link)
    gain = {m: times["off"] / t for m, t in times.items()}
    if requested is ParallelMode.SEQUENCE:
        if refusal is None:
            return Decision(ParallelMode.SEQUENCE, "forced", times)
        mode = ParallelMode.HEADS if heads_ok else ParallelMode.OFF
        return Decision(mode, f"sequence refused: {refusal}", times)
    if requested is ParallelMode.HEADS:
        return Decision(ParallelMode.HEADS if heads_ok else ParallelMode.OFF,
                        "forced" if heads_ok else "Dual-Sage is not applied or the call is "
                        "below its min_tokens", times)
    best = min(times, key=times.get)  # type: ignore[arg-type]
    if best != "off" and gain[best] < facts.margin:
        best = "off"
    why = ", ".join(f"{m} {t:.1f} ms" for m, t in sorted(times.items()))
    reason = f"predicted per block at {seq_len:,} tokens: {why}"
    if refusal is not None:
        reason += f"; sequence refused: {refusal}"
    return Decision(ParallelMode(best), reason, times)
