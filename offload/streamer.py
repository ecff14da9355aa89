"""When it moves: the block streamer's hooks around each streamed block.

`begin(block)` runs just before a streamed block computes: its copy is normally already in a
slot (issued K blocks earlier), so compute only waits on the copy's event; then the copies of the
next K streamed blocks (circular execution order, so the end of one step prefetches the start of
the next) are issued into slots whose blocks have finished. `end(block)` records the event that
releases the block's slot and points its tensors back at their host copy. In the steady state
nothing here synchronises the host: all ordering is stream-waits on events.

`prepare()` runs once per forward, before any block: the first time it copies every streamed
block's weights, as the loader left them (LoRA patches already applied), into the host arena;
later it re-copies only blocks whose tensors the loader replaced since.
"""

from __future__ import annotations

import logging
from enum import Enum

import torch

from . import sizing
from .arena import HostArena, HostBuffer, StagingRing
from .engine import CopyEngine, make_engine, root_device
from .slots import SlotRing
from .weights import BlockWeights

log = logging.getLogger(__name__)


class Source(Enum):
    AUTO = "auto"  # pinned while the budget lasts, pageable + staging beyond
    PINNED = "pinned"  # every streamed block pinned
    PAGEABLE = "pageable"  # every streamed block pageable, through the staging ring


class BlockStreamer:
    def __init__(self, modules: dict[str, torch.nn.Module], *, device: torch.device,
                 lookahead: int, pinned_budget_bytes: int | None, source: Source,
                 staging_buffers: int = sizing.STAGING_BUFFERS,
                 engine: CopyEngine | None = None):
        self.modules = modules
        self.order = list(modules)
        self.position = {block_id: i for i, block_id in enumerate(self.order)}
        self.device = root_device(device)
        self.lookahead = lookahead
        self.pinned_budget_bytes = pinned_budget_bytes
        self.source = source
        self.staging_buffers = staging_buffers
        self.engine = engine if engine is not None else make_engine(self.device)
        self.weights: dict[str, BlockWeights] = {}
        self.host: dict[str, HostBuffer] = {}
        self.arena: HostArena | None = None
        self.staging: StagingRing | None = None
        self.slots: SlotRing | None = None
        self._running: dict[str, int] = {}
        self.registrations = 0

    # ------------------------------------------------------------------ setup
    @property
    def prepared(self) -> bool:
        return self.arena is not None

    def prepare(self) -> None:
        """Register the streamed blocks (first call) or re-register those that changed."""
        if not self.order:
            return
        if not self.prepared:
            self._register_all()
        else:
            self._refresh_changed()

    def _register_all(self) -> None:
        self.weights = {b: BlockWeights(b, self.modules[b]) for b in self.order}
        sizes = [self.weights[b].nbytes for b in self.order]
        budget = self.pinned_budget_bytes
        if self.source is Source.AUTO and budget is not None and sum(sizes) > budget:
            # some blocks will be staged: the staging ring's pinned buffers come out of the budget
            budget = max(0, budget - sizing.staging_ring_bytes(max(sizes), self.staging_buffers))
        if self.source is Source.PINNED:
            budget = None
        self.arena = HostArena(budget, can_pin=self.device.type == "cuda")
        want_direct = self.source is not Source.PAGEABLE
        for block_id in self.order:
            self._register(block_id, want_direct)
        self._build_rings()
        log.info("block prefetch: %s", self.describe())

    def _register(self, block_id: str, want_direct: bool) -> None:
        assert self.arena is not None
        weights = self.weights[block_id]
        buffer = self.arena.allocate(weights.nbytes, want_direct)
        # the loader's weights (wherever they are, LoRA already patched in) become the host copy;
        # binding drops the last reference to their device storage, which frees it
        weights.copy_into(buffer.flat)
        weights.bind(buffer.flat)
        self.host[block_id] = buffer
        self.registrations += 1

    def _build_rings(self) -> None:
        largest = max(w.nbytes for w in self.weights.values())
        count = sizing.slot_count(self.lookahead, len(self.order))
        if self.slots is None or self.slots.buffers[0].numel() < largest:
            for weights in self.weights.values():
                weights.forget_views()  # cached views would keep the old slots alive
            self.slots = SlotRing(count, largest, self.device)
        staged = [self.weights[b].nbytes for b in self.order if self.host[b].staged]
        if staged and (self.staging is None or self.staging.buffers[0].flat.numel() < max(staged)):
            if self.staging is not None:
                self.staging.close()
            self.staging = StagingRing(max(staged), self.engine, self.staging_buffers,
                                       can_pin=self.device.type == "cuda")

    def _refresh_changed(self) -> None:
        changed = [b for b in self.order if not self.weights[b].is_bound_to(self.host[b].flat)]
        if not changed:
            return
        # copies already issued may still read the host buffers or write the slots we are about
        # to refill; without this the new weights could be overwritten by stale bytes
        self.engine.synchronize()
        assert self.arena is not None and self.slots is not None
        for block_id in changed:
            weights, old = self.weights[block_id], self.host[block_id]
            self.slots.forget(block_id)
            if self.staging is not None:
                self.staging.discard(block_id)
            if weights.relayout() or weights.nbytes != old.flat.numel():
                weights.forget_views()
                self.arena.forget(old)
                self._register(block_id, want_direct=not old.staged)
            else:
                weights.copy_into(old.flat)
                weights.bind(old.flat)
                self.registrations += 1
        self._build_rings()
        log.info("block prefetch: re-registered %d changed block(s)", len(changed))

    def invalidate(self) -> None:
        """Forget every slot copy and staged fill: weights were patched in place.

        No synchronisation needed: a stale copy still in flight lands before any new copy into
        the same slot, both being on the copy stream in issue order.
        """
        if self.slots is None:
            return
        for block_id in self.order:
            self.slots.forget(block_id)
            if self.staging is not None:
                self.staging.discard(block_id)

    # ------------------------------------------------------------------ hooks
    def begin(self, block_id: str) -> None:
        """Before `block_id` computes: its weights in a slot, the next K copies issued."""
        assert self.slots is not None, "prepare() must run before the first block"
        index = self.slots.slot_of(block_id)
        if index is None:  # first block of the first step, or the order changed
            index = self._issue(block_id, protected={block_id})
        self._prefetch_after(block_id)
        self.engine.compute_wait(self.slots.ready[index])
        weights = self.weights[block_id]
        weights.bind(self.slots.flat(index, weights.nbytes))
        self._running[block_id] = index

    def end(self, block_id: str) -> None:
        """After `block_id`'s compute was issued: release its slot, point it back at host."""
        assert self.slots is not None
        index = self._running.pop(block_id)
        self.weights[block_id].bind(self.host[block_id].flat)
        self.slots.release(index, self.engine.record_compute())

    def _prefetch_after(self, block_id: str) -> None:
        assert self.slots is not None
        n = len(self.order)
        position = self.position[block_id]
        ahead = min(self.lookahead, n - 1)
        upcoming = [self.order[(position + d) % n] for d in range(1, ahead + 1)]
        protected = {block_id, *upcoming}
        for next_id in upcoming:
            if self.slots.slot_of(next_id) is None:
                self._issue(next_id, protected)

    def _issue(self, block_id: str, protected: set[str]) -> int:
        assert self.slots is not None
        index = self.slots.claim(protected | set(self._running))
        released = self.slots.released[index]
        after = [] if released is None else [released]
        nbytes = self.weights[block_id].nbytes
        host = self.host[block_id]
        if host.staged:
            assert self.staging is not None
            staging_index, source = self.staging.take(block_id, host.flat)
            ready = self.engine.copy(self.slots.flat(index, nbytes), source, after)
            self.staging.release(staging_index, ready)
            self._top_up_staging(block_id)
        else:
            ready = self.engine.copy(self.slots.flat(index, nbytes), host.flat, after)
        self.slots.assign(index, block_id, ready)
        return index

    def _top_up_staging(self, after_id: str) -> None:
        """Keep the staging worker busy with the next staged blocks not already in a slot."""
        assert self.staging is not None and self.slots is not None
        n = len(self.order)
        position = self.position[after_id]
        for d in range(1, n):
            next_id = self.order[(position + d) % n]
            if not self.host[next_id].staged or self.slots.slot_of(next_id) is not None:
                continue
            if self.staging.is_pending(next_id):
                continue
            if not self.staging.schedule(next_id, self.host[next_id].flat):
                break

    # ------------------------------------------------------------------ teardown, reporting
    def close(self) -> None:
        """Stop streaming: every streamed block gets its own storage on the device again."""
        if not self.prepared:
            return
        # in-flight copies read host buffers and write slots that are freed below
        self.engine.synchronize()
        assert self.arena is not None
        for block_id in self.order:
            self.weights[block_id].materialize(self.host[block_id].flat, self.device)
            self.weights[block_id].forget_views()
            self.arena.forget(self.host[block_id])
        if self.staging is not None:
            self.staging.close()
        self.host, self.staging, self.slots, self.arena = {}, None, None, None

    def stats(self) -> dict:
        arena, slots, staging = self.arena, self.slots, self.staging
        return {
            "streamed_blocks": len(self.order),
            "staged_blocks": sum(1 for b in self.order if b in self.host and self.host[b].staged),
            "lookahead": self.lookahead,
            "slots": 0 if slots is None else len(slots),
            "slot_bytes": 0 if slots is None else slots.nbytes,
            "pinned_bytes": (0 if arena is None else arena.pinned_bytes)
            + (0 if staging is None else staging.pinned_bytes),
            "host_direct_bytes": 0 if arena is None else arena.direct_bytes,
            "host_pageable_bytes": 0 if arena is None else arena.pageable_bytes,
            "staging_bytes": 0 if staging is None else staging.nbytes,
            "refused_pins": 0 if arena is None else arena.refused_pins,
            "copies": 0 if slots is None else slots.copies,
            "registrations": self.registrations,
        }

    def describe(self) -> str:
        s = self.stats()
        gib = 1 << 30
        return (f"{s['streamed_blocks']} blocks streamed ({s['staged_blocks']} via staging), "
                f"look-ahead {s['lookahead']} in {s['slots']} slots "
                f"({s['slot_bytes'] / gib:.2f} GiB), pinned host {s['pinned_bytes'] / gib:.2f} GiB")
