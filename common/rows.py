"""How a chunked block splits its rows and heads: the ranges it runs (pure Python, no torch).

The chunk wrappers (`wrappers.py`) run exactly these ranges and the sizing (`block_memory`,
`sizing`) predicts the peaks of their largest one, so the sizes it runs are the sizes predicted.
The floors kept here are the shared ones (`common.floors`).
"""

from __future__ import annotations

from ..common import floors as common_floors

ROW_ALIGN = 128  # chunk rows are rounded to GEMM tile multiples so every chunk is a full-tile GEMM


def row_chunks(total: int, chunk: int, floor: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) row ranges covering `total` rows, each at most `chunk` rows.

    Balanced: n = ceil(total / chunk) chunks of nearly equal size (multiples of ROW_ALIGN where
    that leaves the tail at least half a chunk), so no tiny tail chunk falls back to a small-M
    GEMM kernel. `chunk <= 0` or `chunk >= total` gives one range. floor: the rows per call from
    which the phase's GEMMs are known exact (`RowFloors.split_floor`; None: EXACT_MIN_ROWS). A
    chunk of at least min(floor, EXACT_MIN_ROWS) is never realised below the floor: where
    balancing would go under it, fewer (and so larger than `chunk`) chunks are used, one range
    at the least. Smaller explicit chunks are honoured as given.
    """
    if total <= 0:
        return []
    if chunk <= 0 or chunk >= total:
        return [(0, total)]
    floor = common_floors.EXACT_MIN_ROWS if floor is None else floor
    floor = floor if chunk >= min(floor, common_floors.EXACT_MIN_ROWS) else 0
    n = -(-total // chunk)
    if floor and total // n < floor:
        n = max(1, total // floor)
        if n == 1:
            return [(0, total)]
    limit = max(chunk, -(-total // n))
    even = -(-total // n)
    aligned = -(-even // ROW_ALIGN) * ROW_ALIGN
    tail = total - aligned * (n - 1)
    if aligned <= limit and tail >= max(aligned // 2, floor, 1):
        return [(start, min(start + aligned, total)) for start in range(0, total, aligned)]
    base, extra = divmod(total, n)  # the first `extra` chunks take one row more
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def largest_chunk_rows(total: int, chunk: int, floor: int | None = None) -> int:
    """Rows of the largest range `row_chunks(total, chunk, floor)` produces (the peak's)."""
    return max((b - a for a, b in row_chunks(total, chunk, floor)), default=0)


def query_tiles(tokens: int) -> int:
    """(64-row) query tiles per head of one attention call over `tokens` rows."""
    return -(-tokens // common_floors.QUERY_TILE_ROWS)


def head_groups(heads: int, group: int, tokens: int) -> list[tuple[int, int]]:
    """[h0, h1) head ranges of the attention calls for `group` heads per call (0 = one call).

    Balanced: ceil(heads / group) calls whose sizes differ by one head at most, so no tail
    call of one or two heads splits its keys (split-KV) where the others do not. A group of at
    least EXACT_MIN_HEADS is never realised with fewer heads than that, nor with fewer than
    MIN_QUERY_TILES_PER_CALL (head, query tile) work items per call: on short sequences fewer,
    larger groups (or one call) are used. Smaller explicit groups are honoured as given.
    """
    if heads <= 0:
        return []
    if group <= 0 or group >= heads:
        return [(0, heads)]
    n = -(-heads // group)
    if group >= common_floors.EXACT_MIN_HEADS:
        tiles = max(query_tiles(tokens), 1)
        per_call = max(common_floors.EXACT_MIN_HEADS,
                       -(-common_floors.MIN_QUERY_TILES_PER_CALL // tiles))
        n = min(n, heads // per_call)
        if n <= 1:
            return [(0, heads)]
    base, extra = divmod(heads, n)
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def largest_head_group(heads: int, group: int, tokens: int) -> int:
    """Heads of the largest call `head_groups(heads, group, tokens)` makes (0 = one call)."""
    ranges = head_groups(heads, group, tokens)
    return 0 if len(ranges) <= 1 else max(b - a for a, b in ranges)
