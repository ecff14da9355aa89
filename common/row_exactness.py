"""Whether chunked results are bit-identical to unchunked ones: each phase's row floors and the
status note that names what may differ (pure Python, no torch).

Rows: `common.floors.EXACT_MIN_ROWS` and the measured per-shape floors of `common.exact_rows`
(on-activation adapters, weight formats); heads: `common.floors.EXACT_MIN_HEADS` and the query
tiles per call. `dev/bench/sweep_chunk_exactness.py` measures them on the GPU at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..common import floors as common_floors
from .rows import head_groups, row_chunks

if TYPE_CHECKING:  # the block model imports this module: only its types are needed here
    from .block_memory import Adapters, BlockDims


@dataclass(frozen=True)
class RowFloors:
    """Per chunked phase, rows per GEMM call from which row chunks are known bit-identical.

    qkv: qkv_proj and out_proj (the QKV row chunk runs both); ffn: fc1 and fc2, adapters
    included (`exact_rows` derives them from the measured table). 0: only EXACT_MIN_ROWS
    applies; an int: that many rows too; None: no floor is known (`qkv_why` / `ffn_why` say
    which GEMM), so chunks of that phase are never claimed exact (they are still split no finer
    than EXACT_MIN_ROWS, so no tiny tail makes it worse).
    """

    qkv: int | None = 0
    ffn: int | None = 0
    qkv_why: str = ""
    ffn_why: str = ""
    # set on a GPU model and dtype `exact_rows.json` does not list: its base floors are the
    # EXACT_MIN_ROWS rule carried over from the measured GPUs, an assumption the status says
    assumed: str = ""
    # per phase, the weight format's own minimum (`exact_rows.PhaseRule.base`): None the
    # EXACT_MIN_ROWS rule (plain weights), 1 any row count (INT8 ConvRot)
    qkv_base: int | None = None
    ffn_base: int | None = None
    # row slices change the result (NVFP4 without input_scale): the phase is never chunked
    qkv_never: bool = False
    ffn_never: bool = False

    @classmethod
    def of_rules(cls, qkv: Any, ffn: Any, assumed: str = "") -> RowFloors:
        """From the two phases' `exact_rows.PhaseRule`s."""
        return cls(qkv.floor, ffn.floor, qkv.why, ffn.why, assumed=assumed, qkv_base=qkv.base,
                   ffn_base=ffn.base, qkv_never=qkv.never, ffn_never=ffn.never)

    def known(self, phase: str) -> bool:
        return getattr(self, phase) is not None

    def never(self, phase: str) -> bool:
        return bool(getattr(self, f"{phase}_never"))

    def base(self, phase: str) -> int:
        value = getattr(self, f"{phase}_base")
        return common_floors.EXACT_MIN_ROWS if value is None else value

    def split_floor(self, phase: str) -> int:
        """The floor `row_chunks` keeps this phase's chunks at (see there)."""
        return max(self.base(phase), getattr(self, phase) or 0)

    def exact_from(self, phase: str) -> int:
        """The smallest requested chunk `row_chunks` realises exactly (at or above the floor)."""
        return min(self.split_floor(phase), common_floors.EXACT_MIN_ROWS)

    def why(self, phase: str) -> str:
        return getattr(self, f"{phase}_why") or f"{phase} has no known row floor"


def planned_floors(dims: BlockDims, adapters: Adapters,
                   weight_format: str = "bfloat16") -> RowFloors:
    """Floors the planner predicts with: the measured GPUs' table for these widths and adapters
    (one rank on every adapted linear), before the GPU's own kernels are known. weight_format:
    the DiT's block linears' (`exact_rows.FORMAT_RULES`: "int8_convrot" needs no row floor)."""
    return _planned_floors(dims, adapters, weight_format)


@lru_cache(maxsize=256)
def _planned_floors(dims: BlockDims, adapters: Adapters, weight_format: str) -> RowFloors:
    from ..common import exact_rows

    counts = {"qkv_proj": adapters.qkv, "out_proj": adapters.out_proj, "fc1": adapters.fc1,
              "fc2": adapters.fc2}
    ranks = {name: (adapters.rank,) if n > 0 else () for name, n in counts.items()}
    shapes = exact_rows.linear_shapes(dims.hidden, dims.inner, dims.ffn)
    table = exact_rows.planning_table()
    formats = dict.fromkeys(counts, weight_format)
    found = {phase: exact_rows.phase_rule(table, shapes, ranks, linears,
                                          where="the measured GPUs", formats=formats)
             for phase, linears in exact_rows.PHASE_LINEARS.items()}
    return RowFloors.of_rules(found["qkv"], found["ffn"])


def floors_or_planned(floors: RowFloors | None, dims: BlockDims,
                      adapters: Adapters) -> RowFloors:
    """`floors`, or the planner's (`planned_floors`) when None."""
    return planned_floors(dims, adapters) if floors is None else floors


def row_reasons(phase: str, value: int | str, floors: RowFloors, *,
                tokens: int | None = None) -> list[str]:
    """Why chunks of `value` rows in `phase` may differ from the unchunked call ([] when
    exact). With `tokens`, only a value that really splits the sequence counts."""
    if not value or floors.never(phase):  # a never-split phase runs whole (the plan says so)
        return []
    if isinstance(value, int) and tokens is not None and \
            len(row_chunks(tokens, value, floors.split_floor(phase))) <= 1:
        return []
    if not floors.known(phase):
        if value == "auto":
            return [f"{floors.why(phase)}, if memory needs the {phase} chunked"]
        return [floors.why(phase)]
    if isinstance(value, int) and value < floors.exact_from(phase):
        return [f"{phase} chunks of {value} rows (< {floors.split_floor(phase)})"]
    return []


def head_reasons(head_group: int | str, *, heads: int | None = None,
                 tokens: int | None = None) -> list[str]:
    if not isinstance(head_group, int) or not 0 < head_group < common_floors.EXACT_MIN_HEADS:
        return []
    if heads is not None and tokens is not None and \
            len(head_groups(heads, head_group, tokens)) <= 1:
        return []
    return [f"{head_group} heads per attention call (< {common_floors.EXACT_MIN_HEADS})"]


def note_of(reasons: list[str] | tuple[str, ...]) -> str:
    """'exact', or the status note naming what may make chunked results differ."""
    if not reasons:
        return "exact"
    return f"may differ from unchunked at bf16 rounding ({'; '.join(dict.fromkeys(reasons))})"


def exactness_note(ffn_chunk: int | str, qkv_chunk: int | str, head_group: int | str,
                   floors: RowFloors | None = None) -> str:
    """'exact', or what may make chunked results differ from unchunked ones at bf16 rounding.

    Rows: chunks of at least EXACT_MIN_ROWS (or "auto", which never goes below) are realised at
    or above the phase's floor (`RowFloors`; default: EXACT_MIN_ROWS only), which keeps cuBLAS
    on the unchunked call's kernels; a phase without a known floor (an on-activation adapter
    nobody measured on this GPU) is not claimed exact. Heads: groups of at least
    EXACT_MIN_HEADS keep flash attention free of split-KV (`head_groups` enlarges them on short
    sequences). `dev/bench/sweep_chunk_exactness.py` measures the floors on other GPUs.
    """
    floors = RowFloors() if floors is None else floors
    reasons = [*row_reasons("ffn", ffn_chunk, floors), *row_reasons("qkv", qkv_chunk, floors),
               *head_reasons(head_group)]
    return note_of(reasons)
