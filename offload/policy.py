"""Residency policy: which DiT blocks stay on the GPU and in which order the rest stream.

The plan gives a count; this module picks the blocks. Choice: *spread*, resident blocks evenly
spaced and starting with block 0. Why not the first N:
- throughput: the copy engine must deliver one streamed block per block of compute. With the
  resident blocks interleaved, every resident block's compute is extra time for the next copy,
  so the slack per streamed copy is `blocks / streamed` block-times instead of one. With the
  first N resident, the streamed blocks run back to back and a copy slower than one block's
  compute (short sequences) shows on every one of them;
- the step boundary: block 0 resident gives the first streamed copies of a step something to
  hide behind (they are issued at the end of the previous step, but the sampler's own work
  between steps is short).
The token refiner's blocks run first, on text only; when streamed they lead the order.
"""

from __future__ import annotations


def spread_resident(blocks: int, resident: int) -> tuple[int, ...]:
    """Indices of `resident` of `blocks` blocks, evenly spaced, starting with block 0."""
    if resident < 0 or resident > blocks:
        raise ValueError(f"resident_blocks={resident} must be between 0 and {blocks}")
    return tuple((j * blocks) // resident for j in range(resident))


def streamed_order(blocks: int, resident: tuple[int, ...], refiner_blocks: int = 0,
                   stream_refiner: bool = True) -> list[str]:
    """Execution order of the streamed blocks, as block ids ("token_refiner.blocks.0", ...)."""
    order = [f"token_refiner.blocks.{j}" for j in range(refiner_blocks)] if stream_refiner else []
    keep = set(resident)
    order += [f"blocks.{i}" for i in range(blocks) if i not in keep]
    return order


def longest_streamed_run(blocks: int, resident: tuple[int, ...]) -> int:
    """Most consecutive streamed blocks (circularly): how long copies get no extra slack."""
    if not resident:
        return blocks
    keep = sorted(resident)
    inner = [b - a - 1 for a, b in zip(keep, keep[1:], strict=False)]
    wrap = blocks - keep[-1] - 1 + keep[0]
    return max([*inner, wrap])
