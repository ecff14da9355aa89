"""Who computes what: token rows and attention heads per device, as a declarative plan.

`SequenceSplit.devices[0]` is the root (the GPU the DiT forward runs on; the residual stream
comes from and returns to it). Each device owns one contiguous range of the packed token rows
for the whole block loop (norms, modulation, projections, RoPE, FFN, gates: all per token) and
one contiguous range of heads for attention, which it computes over every row. Rows follow the
devices' throughput weights; heads too. Within a device, heads are attended in chunks of about
`chunk_heads` (never fewer: a call's head count picks the attention kernel on some backends,
and the measured exact range on H200 flash attention starts at 4 heads), so transfers of the next
chunk overlap the attention of this one.

Exactness needs each device's row share inside the range where the GEMM kernel does not change
with the row count (cuBLAS on H200: >= 4096 rows, measured by the chunking work; with
on-activation adapters their GEMMs' measured floors, `chunking.exact_rows`, which can be higher
or unknown; per weight format: INT8 ConvRot weights need no floor), and each attention call's
heads inside the measured exact range of the head subsets (on the CPU with more than one thread:
2 heads, `common.exactness`). `refusal` says why a length falls outside it; the caller then
runs the step another way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..common.exactness import default_range

# smallest row share whose GEMMs matched the full-length run on H200 (the chunking floor)
from ..common.floors import EXACT_MIN_ROWS as EXACT_MIN_ROWS_GPU  # noqa: E402
from ..common.floors import MIN_QUERY_TILES_PER_CALL
from ..common.split import DeviceSplit, heads_by_weights, ranges_of
from ..common.split import split_by_weights as _split_by_weights
from .sizing import DEFAULT_CHUNK_HEADS

# CPU stand-ins (tests): small-M paths for a few rows (1-3 rows differed on AVX2; fp32 with two
# threads up to 11 rows on x86-64, torch 2.13; bf16 none)
EXACT_MIN_ROWS_CPU = 16


def split_by_weights(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Largest-remainder rounding of `total` in proportion to `weights` (sums to `total`)."""
    _check_weights(weights)
    return _split_by_weights(total, weights)


def _check_weights(weights: Sequence[float]) -> None:
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"throughput weights {tuple(weights)} must all be > 0")


def head_chunks(start: int, stop: int, chunk_heads: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) cut into max(1, n // chunk_heads) near-equal chunks, none below chunk_heads
    (unless the whole range is smaller): 28 heads by 4 -> 7 x 4; 14 by 4 -> 5, 5, 4; 7 -> one 7."""
    n = stop - start
    if n <= 0:
        return ()
    pieces = max(1, n // max(chunk_heads, 1))
    return tuple((start + a, start + b) for a, b in ranges_of(split_by_weights(n, [1.0] * pieces)))


# Both shares on one GPU: only the one-GPU plumbing tests and benches set this (a second ComfyUI
# clone on the root's own GPU proves the helper path where one GPU is lent). Users never reach it:
# their device lists are refused earlier (nodes/devices.validate_devices names the repeated GPU).
ALLOW_SHARED_GPU = False


@dataclass(frozen=True)
class SequenceSplit(DeviceSplit):
    """Devices (root first) and their heads (`common.split.DeviceSplit`), their throughput
    weights for the rows, the chunking of heads."""

    row_weights: tuple[float, ...] = ()
    chunk_heads: int = DEFAULT_CHUNK_HEADS
    min_rows: int | None = None  # None: EXACT_MIN_ROWS_GPU on GPUs, _CPU on CPU stand-ins

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.devices)
        if len(self.row_weights) != n:
            raise ValueError(f"{n} devices need {n} row weights and {n} head counts, got "
                             f"{self.row_weights} and {self.head_counts}")
        if any(w <= 0 for w in self.row_weights):
            raise ValueError(f"row weights {self.row_weights} must all be > 0")
        if self.chunk_heads < 1:
            raise ValueError(f"chunk_heads={self.chunk_heads} must be >= 1")

    @property
    def what(self) -> str:
        return "sequence parallel"

    def shared_gpu_allowed(self) -> bool:
        return ALLOW_SHARED_GPU

    @classmethod
    def even(cls, devices: Sequence[torch.device], heads: int, **kwargs) -> SequenceSplit:
        n = len(devices)
        if heads % n:
            raise ValueError(f"{heads} heads do not divide over {n} GPUs; use a GPU count that "
                             f"divides {heads} (e.g. 2, 4, 7, 8 for H3's 56) or weights")
        return cls(devices=tuple(devices), head_counts=(heads // n,) * n,
                   row_weights=(1.0,) * n, **kwargs)

    @classmethod
    def weighted(cls, devices: Sequence[torch.device], heads: int, weights: Sequence[float],
                 **kwargs) -> SequenceSplit:
        """Rows and heads both in proportion to `weights` (each device at least one head)."""
        _check_weights(weights)
        counts = heads_by_weights(heads, weights)
        return cls(devices=tuple(devices), head_counts=counts,
                   row_weights=tuple(float(w) for w in weights), **kwargs)

    # ------------------------------------------------------------------ derived
    @property
    def exact_min_rows(self) -> int:
        if self.min_rows is not None:
            return self.min_rows
        if any(d.type == "cuda" for d in self.devices):
            return EXACT_MIN_ROWS_GPU
        return EXACT_MIN_ROWS_CPU

    def chunk_heads_for(self, seq_len: int) -> int:
        """Heads per attention call at this length: `chunk_heads`, raised so every call keeps
        at least MIN_QUERY_TILES_PER_CALL (head, 64-row query tile) work items. Fewer make flash
        attention split the keys (split-KV), which changes the summation order."""
        if not any(d.type == "cuda" for d in self.devices):
            # CPU stand-ins: no split-KV kernels, but the measured head minimum of a call
            return max(self.chunk_heads, default_range().cpu_heads())
        tiles = max(1, -(-seq_len // 64))
        return max(self.chunk_heads, -(-MIN_QUERY_TILES_PER_CALL // tiles))

    def chunks_of(self, device_index: int, seq_len: int) -> tuple[tuple[int, int], ...]:
        """Global [h0, h1) head chunks device `device_index` attends, in order."""
        start, stop = self.head_ranges()[device_index]
        return head_chunks(start, stop, self.chunk_heads_for(seq_len))

    def attention_plan(self, seq_len: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...],
                                                    tuple[tuple[int, int], ...]]:
        """Every device's head chunks at this length, and the (device, chunk) order the block
        issues them in (chunk rounds, devices in turn). The same for every block of a step:
        cached."""
        return _attention_plan(self, seq_len)

    def rows_for(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        """Contiguous [a, b) row ranges per device for a sequence of `seq_len` rows."""
        return ranges_of(split_by_weights(seq_len, self.row_weights))

    def head_refusal(self) -> str | None:
        """Why a device's head share cannot be attended exactly (None: every one can)."""
        if any(d.type == "cuda" for d in self.devices):
            return None  # GPUs: `chunk_heads_for` keeps each call in the exact range
        need = default_range().cpu_heads()
        fewest = min(self.head_counts)
        if fewest >= need:
            return None
        return (f"a device attends {fewest} head(s); on the CPU with {torch.get_num_threads()} "
                f"threads a call needs >= {need} heads to give the whole call's bits "
                "(common/exact_range.json)")

    def refusal(self, seq_len: int, floor: int | None = 0, why: str = "",
                base: int | None = None) -> str | None:
        """Why a sequence of `seq_len` rows cannot run split exactly (None: it can).

        floor: a higher row floor the blocks' GEMMs need (the on-activation adapters' measured
        floor, `why` names them); None: they have no known floor, so no split is exact.
        base: the weight format's own share floor instead of `exact_min_rows` (1: INT8
        ConvRot); an explicit `min_rows` is kept."""
        heads = self.head_refusal()
        if heads is not None:
            return heads
        if floor is None:
            return f"{why}: no row share is known to be bit-identical"
        shares = [b - a for a, b in self.rows_for(seq_len)]
        own = self.exact_min_rows if base is None or self.min_rows is not None else base
        low = max(own, floor)
        if min(shares) < low:
            cause = (f" ({why})" if why else "")
            return (f"{seq_len:,} tokens give a GPU only {min(shares):,} rows; row shares below "
                    f"{low:,}{cause} may change the GEMM kernel (not bit-identical)")
        return None


@lru_cache(maxsize=64)
def _attention_plan(split: SequenceSplit, seq_len: int):
    chunks = tuple(split.chunks_of(j, seq_len) for j in range(len(split.devices)))
    rounds = max(len(cs) for cs in chunks)
    order = tuple((j, r) for r in range(rounds) for j in range(len(chunks)) if r < len(chunks[j]))
    return chunks, order
