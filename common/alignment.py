"""The flat-buffer alignment of a block's tensors, torch-free.

One rule for the runtime layout (`block_weights.BlockLayout`: the host copy, every device slot,
a helper's replica) and the planner's byte counts (`offload.sizing`), so both agree.
"""

from __future__ import annotations

ALIGNMENT = 256  # bytes; every tensor of a block starts on this boundary in its flat buffer


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to the next multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment
