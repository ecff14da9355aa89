"""Pinned-memory weight prefetcher: DiT blocks stream from host memory just ahead of use.

What moves: `weights` (a block's tensors in one flat layout), `arena` (host copies, pinned within
a budget, a staging ring beyond), `slots` (the device slot ring). When it moves: `streamer`
(begin/end hooks around each streamed block, copies on a side stream ordered by events), with
`engine` (CUDA/ROCm streams or synchronous CPU copies). Which blocks stream: `policy`. Sizes for
the planner, torch-free: `sizing`. ComfyUI seam: `apply`.
"""

from .apply import (
    BlockPrefetch,
    PrefetchConfig,
    apply_block_prefetch,
    get_block_prefetch,
)
from .policy import spread_resident, streamed_order
from .streamer import BlockStreamer, Source

__all__ = [
    "BlockPrefetch",
    "BlockStreamer",
    "PrefetchConfig",
    "Source",
    "apply_block_prefetch",
    "get_block_prefetch",
    "spread_resident",
    "streamed_order",
]
