"""The chunking status line and the per-call row plan it is built from."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import sizing
from .config import ChunkingConfig

log = logging.getLogger(__name__)
_said: set[str] = set()


@dataclass(frozen=True)
class RowPlan:
    """What one block forward runs: chunk sizes (0 = off), the floors `row_chunks` keeps each
    phase's chunks at, why the result may differ from the unchunked block (empty: exact) and
    which phases were left whole to stay exact."""

    ffn_chunk: int
    qkv_chunk: int
    head_group: int
    ffn_floor: int
    qkv_floor: int
    inexact: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    assumed: str = ""  # row chunks ran on a GPU whose floors are not measured (RowFloors)
    notes: tuple[str, ...] = ()  # what the status says besides (an adapter upstream skips)
    tokens: int = 0  # the rows of the block call it was made for

    @property
    def chunks(self) -> tuple[int, int, int]:
        return self.ffn_chunk, self.qkv_chunk, self.head_group


class ChunkingReport:
    """The status line of one `apply_activation_chunking`, kept true at run time.

    Before any forward it says what the config and the adapters visible at apply time allow.
    The block forwards then record what they ran (adapters that ComfyUI injects only while the
    model is loaded, chunks "auto" chose, phases left whole): the line becomes "exact" or names
    every reason seen (`line` is the live status line the seam reads, `protocol.record_status`),
    and each reason is logged once per process.
    """

    def __init__(self, config: ChunkingConfig, block_count: int, heads: int | None,
                 floors: sizing.RowFloors):
        self.config = config
        self.block_count = block_count
        self.heads = heads
        self.apply_note = sizing.exactness_note(config.ffn_chunk, config.qkv_chunk,
                                                config.head_group, floors)
        self.inexact: dict[str, None] = {}
        self.kept: dict[str, None] = {f"{phase} kept whole ({floors.why(phase)})": None
                                      for phase in ("ffn", "qkv")
                                      if floors.never(phase) and getattr(config, f"{phase}_chunk")}
        self.assumed = ""
        self.ran = False

    def line(self) -> str:
        if not self.ran:
            return self.config.status(self.block_count, self.heads, note=self.apply_note,
                                      kept=tuple(self.kept))
        note = sizing.note_of(tuple(self.inexact))
        if note == "exact" and self.assumed:
            note = f"exact as assumed ({self.assumed})"
        return self.config.status(self.block_count, self.heads, note=note,
                                  kept=tuple(self.kept))

    def record(self, plan: RowPlan) -> None:
        new = [r for r in plan.inexact if r not in self.inexact]
        kept = [k for k in (*plan.kept, *plan.notes) if k not in self.kept]
        assumed = plan.assumed and not self.assumed
        if self.ran and not new and not kept and not assumed:
            return
        self.ran = True
        self.assumed = self.assumed or plan.assumed
        self.inexact.update(dict.fromkeys(new))
        self.kept.update(dict.fromkeys(kept))
        for reason in new:
            if reason not in _said:
                _said.add(reason)
                log.warning("activation chunking may differ from unchunked at bf16 rounding "
                            "(%s)", reason)
