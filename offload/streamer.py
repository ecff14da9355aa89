"""When it moves: the block streamer's hooks around each streamed block.

`begin(block)` runs just before a streamed block computes: its copy is normally already in a
slot (issued K blocks earlier), so compute only waits on the copy's event; then the copies of the
next K streamed blocks in execution order are issued into slots whose blocks have finished.
`end(block)` records the event that releases the block's slot and points its tensors back at
their host copy. In the steady state nothing here synchronises the host: all ordering is
stream-waits on events.

Execution order: the *cycle* (the DiT blocks, run once per step: circular, so the end of one
step prefetches the start of the next) and an optional *prologue* (the token refiner's blocks,
which upstream runs once per sampling run while building the conditioning, before the first
step). The prologue leads into the cycle; the cycle never wraps back into the prologue, so the
look-ahead at a step boundary is spent on the next step's blocks.

`prepare()` registers or refreshes the host copies: the first time it copies every streamed
block's weights, as the loader left them (LoRA patches applied), into the host arena; later it
re-copies only blocks whose tensors the loader replaced since. Registration is all or nothing:
a failure part-way gives the blocks already moved their own storage back and leaves the
streamer unregistered, so the next call starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from enum import Enum

import torch

from ..comfy_seam.memory import pin_budget_bytes
from ..common.arena import HostArena, HostBuffer, StagingRing, booked_bytes
from ..common.block_weights import BlockWeights
from ..common.engine import CopyEngine, make_engine, root_device
from ..common.slots import SlotRing
from . import sizing

log = logging.getLogger(__name__)


class Source(Enum):
    AUTO = "auto"  # pinned while the budget lasts, pageable + staging beyond
    PINNED = "pinned"  # every streamed block pinned
    PAGEABLE = "pageable"  # every streamed block pageable, through the staging ring


class BlockStreamer:
    def __init__(self, modules: dict[str, torch.nn.Module], *, device: torch.device,
                 lookahead: int, pinned_budget_bytes: int | None, source: Source,
                 staging_buffers: int = sizing.STAGING_BUFFERS,
                 engine: CopyEngine | None = None, prologue: Sequence[str] = (),
                 can_pin: bool | None = None):
        self.modules = modules
        unknown = [b for b in prologue if b not in modules]
        if unknown:
            raise ValueError(f"prologue blocks {unknown} are not among the streamed blocks")
        self.prologue = list(prologue)
        self.cycle = [b for b in modules if b not in set(self.prologue)]
        # host-copy order: the per-step blocks claim the pinned budget before the prologue's
        self.order = self.cycle + self.prologue
        self.position = {block_id: i for i, block_id in enumerate(self.cycle)}
        self.device = root_device(device)
        self.lookahead = lookahead
        self.pinned_budget_bytes = pinned_budget_bytes
        self.source = source
        self.staging_buffers = staging_buffers
        self.engine = engine if engine is not None else make_engine(self.device)
        self.can_pin = self.device.type == "cuda" if can_pin is None else can_pin
        self.weights: dict[str, BlockWeights] = {}
        self.host: dict[str, HostBuffer] = {}
        self.arena: HostArena | None = None
        self.staging: StagingRing | None = None
        self.slots: SlotRing | None = None
        self._running: dict[str, int] = {}  # running block -> its slot
        self._swapped: dict[str, list] = {}  # running block -> what restore() undoes
        self.registrations = 0
        self.detached_backups = 0  # loader backups given their own bytes (see weights.py)
        self.copies: dict[str, int] = dict.fromkeys(self.order, 0)  # host->slot copies per block

    # ------------------------------------------------------------------ setup
    @property
    def prepared(self) -> bool:
        return self.arena is not None

    def prepare(self) -> None:
        """Register the streamed blocks (first call) or re-register those that changed; make
        sure the device side (slots, staging ring, pinned pages) is there."""
        if not self.order:
            return
        if not self.prepared:
            self._register_all()
        else:
            self._refresh_changed()
            self._repin()
            self._build_rings()

    def _register_all(self) -> None:
        weights = {b: BlockWeights(b, self.modules[b]) for b in self.order}
        sizes = [weights[b].nbytes for b in self.order]
        # inside ComfyUI the host copies share its pin budget: only what is left of it
        budget = pin_budget_bytes(self.pinned_budget_bytes) if self.can_pin \
            else self.pinned_budget_bytes
        direct = sizing.arena_split(sizes, budget, source=self.source.value,
                                    staging_buffers=self.staging_buffers).direct
        arena = HostArena(None, can_pin=self.can_pin)
        host: dict[str, HostBuffer] = {}
        origin: dict[str, torch.device] = {}
        try:
            for block_id, want_direct in zip(self.order, direct, strict=True):
                origin[block_id] = _device_of(weights[block_id])
                host[block_id] = self._register(arena, weights[block_id], want_direct)
            self.weights, self.host, self.arena = weights, host, arena
            self._build_rings()
        except BaseException:
            # give what already moved its own storage back where it came from, drop the arena:
            # the next prepare() starts over instead of finding half a registration
            for block_id, buffer in host.items():
                weights[block_id].materialize(buffer.flat, origin[block_id])
                arena.forget(buffer)
            self.weights, self.host, self.arena, self.slots = {}, {}, None, None
            if self.staging is not None:
                self.staging.close()
                self.staging = None
            raise
        log.info("block prefetch: %s", self.describe())

    def _register(self, arena: HostArena, weights: BlockWeights,
                  want_direct: bool) -> HostBuffer:
        buffer = arena.allocate(weights.nbytes, want_direct)
        try:
            # the loader's weights (wherever they are, LoRA already patched in) become the host
            # copy; binding drops the last reference to their old storage, which frees it
            weights.copy_into(buffer.flat)
            weights.bind(buffer.flat)
        except BaseException:
            arena.forget(buffer)
            raise
        self.registrations += 1
        return buffer

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
                                       can_pin=self.can_pin)

    def _refresh_changed(self) -> None:
        changed = [b for b in self.order if not self.weights[b].is_bound_to(self.host[b].flat)]
        if not changed:
            return
        # copies already issued may still read the host buffers or write the slots we are about
        # to refill; without this the new weights could be overwritten by stale bytes
        self.engine.synchronize()
        assert self.arena is not None
        for block_id in changed:
            self._forget_copies(block_id)
            weights, old = self.weights[block_id], self.host[block_id]
            # a backup the loader took of a tensor bound here must keep its bytes (weights.py)
            self.detached_backups += weights.detach_replaced(old.flat)
            if weights.relayout() or weights.nbytes != old.flat.numel():
                weights.forget_views()
                self.arena.forget(old)
                self.host[block_id] = self._register(self.arena, weights,
                                                     want_direct=not old.staged)
            else:
                weights.copy_into(old.flat)
                weights.bind(old.flat)
                self.registrations += 1
        log.info("block prefetch: re-registered %d changed block(s)", len(changed))

    def _forget_copies(self, block_id: str) -> None:
        if self.slots is not None:
            self.slots.forget(block_id)
        if self.staging is not None:
            self.staging.discard(block_id)

    def invalidate(self) -> None:
        """Forget every slot copy and staged fill: weights were patched in place.

        No synchronisation needed: a stale copy still in flight lands before any new copy into
        the same slot, both being on the copy stream in issue order.
        """
        for block_id in self.order:
            self._forget_copies(block_id)

    def adopt(self, block_id: str, owner: torch.nn.Module, name: str) -> bool:
        """The loader just set `owner.<name>` (a tensor of `block_id`) to new bytes: copy them
        into the block's host copy and bind it there, without a second host copy. False when
        the block is not registered or the tensor no longer fits its layout (then the next
        prepare() re-registers the block)."""
        if not self.prepared or block_id not in self.host:
            return False
        weights, host = self.weights[block_id], self.host[block_id]
        index = weights.ref_index(owner, name)
        if index is None:
            return False
        # a backup taken of the tensor bound here keeps its bytes; then nothing else aliases
        # the host copy and it can be overwritten
        self.detached_backups += weights.detach_replaced(host.flat)
        self._forget_copies(block_id)
        if not weights.adopt(index, host.flat):
            return False
        self.registrations += 1
        return True

    # ------------------------------------------------------------------ hooks
    def begin(self, block_id: str) -> None:
        """Before `block_id` computes: its weights in a slot, the next K copies issued."""
        assert self.slots is not None, "prepare() must run before the first block"
        index = self.slots.slot_of(block_id)
        if index is None:  # first block of a run, or the order changed
            index = self._issue(block_id, protected={block_id})
        self._prefetch_after(block_id)
        self.engine.compute_wait(self.slots.ready[index])
        weights = self.weights[block_id]
        # the block's tensors report the slot's device (quantized ones through a wrapper built
        # there): ComfyUI's cast then uses them as they are instead of copying each weight
        self._swapped[block_id] = weights.swap_in(self.slots.flat(index, weights.nbytes))
        self._running[block_id] = index

    def end(self, block_id: str) -> None:
        """After `block_id`'s compute was issued: release its slot, point it back at host."""
        assert self.slots is not None
        index = self._running.pop(block_id)
        # the module's own objects again, bound to the host copy
        self.weights[block_id].restore(self._swapped.pop(block_id))
        self.slots.release(index, self.engine.record_compute())

    def following(self, block_id: str) -> Iterator[str]:
        """Streamed blocks after `block_id` in execution order (each at most once)."""
        if block_id in self.position:
            n = len(self.cycle)
            start = self.position[block_id]
            yield from (self.cycle[(start + d) % n] for d in range(1, n))
        else:
            yield from self.prologue[self.prologue.index(block_id) + 1:]
            yield from self.cycle

    def _prefetch_after(self, block_id: str) -> None:
        assert self.slots is not None
        upcoming = []
        for next_id in self.following(block_id):
            if len(upcoming) == min(self.lookahead, len(self.slots) - 1):
                break
            upcoming.append(next_id)
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
        self.copies[block_id] += 1
        return index

    def _top_up_staging(self, after_id: str) -> None:
        """Keep the staging worker busy with the next staged blocks not already in a slot."""
        assert self.staging is not None and self.slots is not None
        for next_id in self.following(after_id):
            if not self.host[next_id].staged or self.slots.slot_of(next_id) is not None:
                continue
            if self.staging.is_pending(next_id):
                continue
            if not self.staging.schedule(next_id, self.host[next_id].flat):
                break

    # ------------------------------------------------------------------ lifecycle
    def release_device(self) -> None:
        """Free the device slots and the staging ring (the model left the device). The host
        copies stay, bound; the next prepare() builds the rings again."""
        if self.slots is None and self.staging is None:
            return
        # in-flight copies write the slots and read the staging buffers freed here
        self.engine.synchronize()
        assert not self._running, f"blocks {sorted(self._running)} are still running"
        for weights in self.weights.values():
            weights.forget_views()
        self.slots = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def refresh_host(self) -> None:
        """Take tensors the loader put back (restored backups) into the host copies now, so
        they do not sit beside the host copies until the next run."""
        if self.prepared:
            self._refresh_changed()

    def unpin(self) -> None:
        """Unlock the host copies' pages in place (bytes and binding stay)."""
        if self.arena is not None:
            self.release_device()
            self.arena.unpin(list(self.host.values()))

    def _repin(self) -> None:
        if self.arena is not None and any(b.unpinned for b in self.host.values()):
            refused = self.arena.repin(list(self.host.values()))
            if refused:
                log.warning("block prefetch: page locking refused for %d block(s) after a "
                            "reload; they stream through the staging ring", len(refused))

    def close(self, device: torch.device | None = None) -> None:
        """Stop streaming: every tensor bound to a host copy gets its own storage on `device`
        (default: the streamer's device) and the host copies are freed."""
        if not self.prepared:
            return
        self.release_device()
        assert self.arena is not None
        target = self.device if device is None else torch.device(device)
        for block_id in self.order:
            self.weights[block_id].materialize(self.host[block_id].flat, target)
            self.weights[block_id].forget_views()
            self.arena.forget(self.host[block_id])
        self.host, self.arena = {}, None

    def stats(self) -> dict:
        arena, slots, staging = self.arena, self.slots, self.staging
        return {
            "streamed_blocks": len(self.order),
            "prologue_blocks": len(self.prologue),
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
            # of the pinned bytes, what ComfyUI counts in its pin budget (whole pages)
            "booked_bytes": booked_bytes(self.host.values())
            + (0 if staging is None else staging.booked_bytes),
            "copies": sum(self.copies.values()),
            "registrations": self.registrations,
            "detached_backups": self.detached_backups,
        }

    def describe(self) -> str:
        s = self.stats()
        gib = 1 << 30
        return (f"{s['streamed_blocks']} blocks streamed ({s['staged_blocks']} via staging), "
                f"look-ahead {s['lookahead']} in {s['slots']} slots "
                f"({s['slot_bytes'] / gib:.2f} GiB), pinned host {s['pinned_bytes'] / gib:.2f} GiB")


def _device_of(weights: BlockWeights) -> torch.device:
    tensors = weights.tensors()
    return tensors[0].device if tensors else torch.device("cpu")
