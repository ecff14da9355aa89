"""`SequenceParallelConfig`, and `config_from_plan`: the planner's choice as a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common.geometry import HEADS
from ..exchange.mode import ParallelMode
from ..exchange.transport import TransportMode
from . import sizing
from .threads import DEFAULT_TIMEOUT_S
from .weights import REPLICA, STREAM


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
    """The planner's choice as a config: devices, row weights, link and GPU rates (converted by
    `sizing.gpu_speed` / `sizing.link_speed`, the planner's own conversion)."""
    parallel = plan.parallel
    profile = plan.profile
    order = parallel.sequence_devices([plan.root_device, *plan.helper_devices])
    quantized = bool(getattr(plan.request, "quantized_attention", False))
    # the attention kernel the plan was timed with (older plans: the quantized flag)
    kernel = getattr(getattr(plan, "attention", None), "kernel", None)
    speeds = tuple(sizing.gpu_speed(profile.gpus[i], kernel or quantized) for i in order)
    # the helper streams its DiT when the plan found no room for a replica in some pass (the
    # runtime's own "auto" looks at the first split step only, and keeps its choice)
    planned = {p.helper_weights for p in parallel.passes.values() if p.mode == "sequence"}
    link = sizing.link_speed(profile.link)
    values: dict[str, Any] = dict(
        parallel=("sequence" if parallel.requested in ("sequence", "cfg_sequence") else
                  "off" if parallel.requested == "off" else "auto"),
        helpers=tuple(f"cuda:{i}" for i in order[1:]),
        split=":".join(f"{w:g}" for w in parallel.row_weights[:len(order)]),
        transport=parallel.transport if parallel.transport in ("peer", "host") else "auto",
        gpu_speeds=speeds, link_gbps=link.gbps, host_gbps=link.host_gbps,
        helper_weights=STREAM if STREAM in planned else "auto",
        note="plan: " + ", ".join(f"{name.upper()} {p.mode} ({p.speedup:.2f}x predicted)"
                                  for name, p in parallel.passes.items()))
    values.update(overrides)
    return SequenceParallelConfig(**values)
