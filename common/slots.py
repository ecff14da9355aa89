"""Device side of what moves: a ring of flat slots, each big enough for the largest block.

Bookkeeping only; the streamer decides when a slot is filled. Per slot: which block it holds,
the copy event that says its bytes arrived (`ready`), and the event recorded after the last
compute that read it (`released`). A slot is refilled only after `released`: the copy into it
waits on that event, so a block's weights are never overwritten while its kernels run.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotRing:
    def __init__(self, count: int, nbytes: int, device: torch.device):
        # allocated once and kept for the streamer's life, so the caching allocator never hands
        # a slot's memory to another tensor while a copy or a kernel still uses it
        # normal tensors (not inference tensors) whatever mode the first run had: later runs
        # write them in place under either mode
        with torch.inference_mode(False):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                            for _ in range(count)]
        self.holder: list[str | None] = [None] * count
        self.ready: list[Any] = [None] * count
        self.released: list[Any] = [None] * count
        self._last_use = [-1] * count
        self._tick = 0
        self._where: dict[str, int] = {}
        self.copies = 0

    def __len__(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def slot_of(self, block_id: str) -> int | None:
        return self._where.get(block_id)

    def claim(self, protected: set[str]) -> int:
        """A slot to refill: an empty one, else the least recently used unprotected one."""
        for index, holder in enumerate(self.holder):
            if holder is None:
                return index
        candidates = [i for i, holder in enumerate(self.holder) if holder not in protected]
        assert candidates, f"all {len(self)} slots hold protected blocks {sorted(protected)}"
        return min(candidates, key=lambda i: self._last_use[i])

    def assign(self, index: int, block_id: str, ready: Any) -> None:
        old = self.holder[index]
        if old is not None:
            del self._where[old]
        self.holder[index] = block_id
        self.ready[index] = ready
        self._where[block_id] = index
        self._last_use[index] = self._tick
        self._tick += 1
        self.copies += 1

    def release(self, index: int, event: Any) -> None:
        self.released[index] = event
        self._last_use[index] = self._tick
        self._tick += 1

    def flat(self, index: int, nbytes: int) -> torch.Tensor:
        return self.buffers[index][:nbytes]

    def forget(self, block_id: str) -> None:
        """Drop a block's copy (its weights changed); `released` stays, still to be honoured."""
        index = self._where.pop(block_id, None)
        if index is not None:
            self.holder[index] = None
            self.ready[index] = None
