"""The DiT blocks' weights on a helper GPU: a resident replica, or a slot ring streamed from host.

The fallback for models ComfyUI cannot clone per GPU (a loader without a reload factory, the
twin, a release without multi-GPU clones: `comfy_seam.clones.clone_refusal`); otherwise each helper
runs a ComfyUI-managed clone and nothing here is used.

Each helper share runs upstream's block forward on a module copy of its own (`ModuleCopy`: the
block's module tree copied, its tensors shared at first), whose parameter and buffer tables are
pointed at the helper's copy of the weights (a new tensor object per entry, a wrapper on the
helper's device for quantized ones). The root's modules and tensors are never touched, so the
root share runs the same block on its own thread at the same time. What is attached to the
root's modules when the copy is made (bypass adapters, an installed forward) is copied with
them, bound to the copy; adapter tensors stay where they are (a GPU root's adapters make the
helper fail and the step fall back to one GPU: the status line names this binding).

Two sources:
- `replica`: one flat buffer per block on the helper (the `common.block_weights` layout), filled
  from the root's current tensors, wherever they live (root GPU, or the prefetcher's host arena).
- `stream`: K + 1 slots on the helper, filled on a copy stream K blocks ahead from a host copy:
  the prefetcher's pinned arena for the blocks it streams (both GPUs read the same host copy),
  and a host copy of our own for blocks resident on the root.

Weight changes: ComfyUI patches LoRA by replacing parameters (or writing in place and stamping
the model with a new `current_weight_patches_uuid`). `signature()` captures both (tensor objects,
their storage pointers, the stamp, the prefetcher's re-registrations); a change re-copies the
replica, or forgets every streamed slot and our own host copies, before the next forward's first
block. `close()` frees every buffer.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..comfy_seam.devices import device_context
from ..common.arena import HostArena, HostBuffer
from ..common.block_weights import PLAIN, BlockWeights, device_wrapper, is_quantized, leaves_of
from ..common.engine import make_engine
from ..common.slots import SlotRing

REPLICA = "replica"
STREAM = "stream"


class HelperWeights:
    """Block weights on one helper device; `use(i)` yields block i's module copy bound to them."""

    def __init__(self, device: torch.device, blocks: list[torch.nn.Module], mode: str, *,
                 lookahead: int = 2, pinned_budget_bytes: int | None = None):
        if mode not in (REPLICA, STREAM):
            raise ValueError(f"helper weights mode {mode!r}: use {REPLICA!r} or {STREAM!r}")
        self.device = device
        self.blocks = blocks
        self.mode = mode
        self.lookahead = max(1, lookahead)
        self.weights = [BlockWeights(f"blocks.{i}", m) for i, m in enumerate(blocks)]
        self.modules: list[ModuleCopy] = []  # made at `refresh`, from the root's blocks then
        self._signature: Any = None
        # replica
        self.replica: list[torch.Tensor | None] = [None] * len(blocks)
        # stream
        self.engine = make_engine(device) if mode == STREAM else None
        self.slots: SlotRing | None = None
        self.arena: HostArena | None = None
        self.own_host: dict[int, HostBuffer] = {}
        self.pinned_budget_bytes = pinned_budget_bytes
        self._running: dict[int, int] = {}
        self.copies = 0
        self.refreshes = 0

    # ------------------------------------------------------------------ sizes
    @property
    def total_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def device_bytes(self) -> int:
        if self.mode == REPLICA:
            return sum(t.numel() for t in self.replica if t is not None)
        return 0 if self.slots is None else self.slots.nbytes

    # ------------------------------------------------------------------ freshness
    def signature(self, base_model: Any, prefetch: Any) -> tuple:
        """What identifies the weights now; any change means the copies are stale."""
        streamer = getattr(prefetch, "streamer", None)
        streamed = getattr(prefetch, "streamed_ids", frozenset())
        parts: list[Any] = [getattr(base_model, "current_weight_patches_uuid", None),
                            getattr(streamer, "registrations", None)]
        for i, weights in enumerate(self.weights):
            block_id = f"blocks.{i}"
            if streamer is not None and block_id in streamed and block_id in streamer.host:
                # bound to a root slot or to the host copy depending on when we look: the host
                # copy is the stable identity of a streamed block
                parts.append(("host", id(streamer.host[block_id])))
                continue
            parts.append(tuple((id(t), tuple(leaf.data_ptr() for _, leaf in leaves_of(t)))
                               for t in weights.tensors()))
        return tuple(parts)

    def refresh(self, base_model: Any, prefetch: Any) -> bool:
        """Before a forward's first block: (re)copy what changed. True when something did."""
        signature = self.signature(base_model, prefetch)
        if signature == self._signature:
            return False
        self._drain()
        for weights in self.weights:
            if weights.relayout():
                weights.forget_views()
        if self.mode == REPLICA:
            self._fill_replica()
        else:
            self._reset_stream(prefetch)
        # copies of what the root's blocks are now (adapters injected at load included)
        self.modules = [ModuleCopy(block) for block in self.blocks]
        self._signature = signature
        self.refreshes += 1
        return True

    def _fill_replica(self) -> None:
        with device_context(self.device):
            for i, weights in enumerate(self.weights):
                flat = self.replica[i]
                if flat is None or flat.numel() != weights.nbytes:
                    weights.forget_views()
                    with torch.inference_mode(False):  # refilled in place under either mode
                        flat = torch.empty(weights.nbytes, dtype=torch.uint8,
                                           device=self.device)
                    self.replica[i] = flat
                weights.copy_into(flat)
            if self.device.type == "cuda":
                # setup only: the compute stream must not read the replica before it is filled
                torch.cuda.synchronize(self.device)
        self.copies += len(self.weights)

    def _reset_stream(self, prefetch: Any) -> None:
        self._prefetch = prefetch
        for buffer in self.own_host.values():
            if self.arena is not None:
                self.arena.forget(buffer)
        self.own_host = {}
        largest = max(w.nbytes for w in self.weights)
        count = min(self.lookahead + 1, len(self.weights))
        if self.slots is None or self.slots.buffers[0].numel() < largest:
            for weights in self.weights:
                weights.forget_views()
            self.slots = SlotRing(count, largest, self.device)
        else:
            for i in range(len(self.weights)):
                self.slots.forget(f"blocks.{i}")

    # ------------------------------------------------------------------ use
    @contextlib.contextmanager
    def use(self, index: int) -> Iterator[torch.nn.Module]:
        """Block `index`'s module copy, bound to this helper's copy of its weights."""
        module = self.modules[index]
        module.bind(self._flat(index))
        yield module.module

    def begin(self, index: int) -> None:
        """Before block `index`'s first helper kernel: its copy is in a slot (stream mode)."""
        if self.mode != STREAM:
            return
        assert self.slots is not None and self.engine is not None
        block_id = f"blocks.{index}"
        slot = self.slots.slot_of(block_id)
        if slot is None:
            slot = self._issue(index, protected={block_id})
        n = len(self.weights)
        upcoming = [(index + d) % n for d in range(1, min(self.lookahead, n - 1) + 1)]
        protected = {block_id, *(f"blocks.{j}" for j in upcoming)}
        for j in upcoming:
            if self.slots.slot_of(f"blocks.{j}") is None:
                self._issue(j, protected)
        # the block's kernels read the slot: they must not start before its bytes arrived
        self.engine.compute_wait(self.slots.ready[slot])
        self._running[index] = slot

    def end(self, index: int) -> None:
        """After block `index`'s last helper kernel was queued: its slot may be refilled."""
        if self.mode != STREAM:
            return
        assert self.slots is not None and self.engine is not None
        slot = self._running.pop(index, None)
        if slot is not None:
            self.slots.release(slot, self.engine.record_compute())

    def _flat(self, index: int) -> torch.Tensor:
        nbytes = self.weights[index].nbytes
        if self.mode == REPLICA:
            flat = self.replica[index]
            assert flat is not None, "refresh() fills the replica before the first block"
            return flat
        assert self.slots is not None
        slot = self._running.get(index)
        assert slot is not None, "begin(index) must run before use(index)"
        return self.slots.flat(slot, nbytes)

    def _issue(self, index: int, protected: set[str]) -> int:
        assert self.slots is not None and self.engine is not None
        running = {f"blocks.{i}" for i in self._running}
        slot = self.slots.claim(protected | running)
        released = self.slots.released[slot]
        source = self._host_source(index)
        nbytes = self.weights[index].nbytes
        # the slot's previous block may still be read by helper kernels: the copy waits for them
        ready = self.engine.copy(self.slots.flat(slot, nbytes), source,
                                 [] if released is None else [released])
        self.slots.assign(slot, f"blocks.{index}", ready)
        self.copies += 1
        return slot

    def _host_source(self, index: int) -> torch.Tensor:
        """The host copy of block `index`: the prefetcher's (same layout) or our own."""
        block_id = f"blocks.{index}"
        streamer = getattr(getattr(self, "_prefetch", None), "streamer", None)
        if streamer is not None and block_id in getattr(self._prefetch, "streamed_ids", ()):
            host = streamer.host.get(block_id)
            theirs = streamer.weights.get(block_id)
            if host is not None and theirs is not None and \
                    theirs.layout.signature() == self.weights[index].layout.signature():
                return host.flat
        buffer = self.own_host.get(index)
        if buffer is None:
            if self.arena is None:
                self.arena = HostArena(self.pinned_budget_bytes, can_pin=self.device.type == "cuda")
            weights = self.weights[index]
            buffer = self.arena.allocate(weights.nbytes, want_direct=True)
            weights.copy_into(buffer.flat)  # setup of this block's host copy, once per change
            self.own_host[index] = buffer
        return buffer.flat

    # ------------------------------------------------------------------ teardown
    def _drain(self) -> None:
        """Wait for every queued use of the buffers about to be rewritten or freed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._drain()
        self.modules = []
        self.replica = [None] * len(self.blocks)
        for weights in self.weights:
            weights.forget_views()
        if self.arena is not None:
            for buffer in self.own_host.values():
                self.arena.forget(buffer)
        self.own_host, self.arena, self.slots = {}, None, None
        self._running = {}
        self._signature = None


def choose_mode(requested: str, device: torch.device, weights_bytes: int, reserve_bytes: int,
                free_bytes: Callable[[torch.device], int | None]) -> tuple[str, str]:
    """(mode, reason): a replica when it fits beside `reserve_bytes` of activations."""
    if requested in (REPLICA, STREAM):
        return requested, "as configured"
    free = free_bytes(device)
    if free is None:
        return REPLICA, "CPU stand-in device"
    gib = 1 << 30
    if weights_bytes + reserve_bytes <= free:
        return REPLICA, (f"replica {weights_bytes / gib:.1f} GiB fits in {free / gib:.1f} GiB "
                         f"free beside {reserve_bytes / gib:.1f} GiB of activations")
    return STREAM, (f"replica {weights_bytes / gib:.1f} GiB does not fit in {free / gib:.1f} GiB "
                    f"free beside {reserve_bytes / gib:.1f} GiB of activations: streamed")




class ModuleCopy:
    """A copy of a block's module tree for one helper, its tables bound to flat buffers.

    The copy starts with the root's tensor objects (nothing is duplicated); `bind` replaces
    each table entry of the copy by a new object on the buffer's views (a plain tensor, or a
    quantized wrapper reporting the buffer's device so ComfyUI's cast does not move it), never
    changing an object the root holds. Bound objects are kept per buffer and reused."""

    def __init__(self, block: torch.nn.Module):
        self.module = copy.deepcopy(block, _shared_memo(block))
        self.weights = BlockWeights("copy", self.module)
        self.originals = [ref.current() for ref in self.weights.refs]
        self._bound: dict[int, list[torch.Tensor]] = {}
        self._current: int | None = None

    def bind(self, flat_u8: torch.Tensor) -> None:
        key = flat_u8.data_ptr()
        if key == self._current:
            return
        objects = self._bound.get(key)
        if objects is None:
            objects = []
            for tensor, views in zip(self.originals, self.weights.views(flat_u8), strict=True):
                if is_quantized(tensor):
                    objects.append(device_wrapper(tensor, views))
                elif isinstance(tensor, torch.nn.Parameter):
                    objects.append(torch.nn.Parameter(views[PLAIN], requires_grad=False))
                else:
                    objects.append(views[PLAIN])
            self._bound[key] = objects
        for ref, obj in zip(self.weights.refs, objects, strict=True):
            table = ref.owner._buffers if ref.is_buffer else ref.owner._parameters
            table[ref.name] = obj
        self._current = key


_SHARED = (torch.Tensor, types.ModuleType, type(threading.Lock()), type(threading.RLock()))


def _shared_memo(root: Any, limit: int = 100_000) -> dict[int, Any]:
    """A deepcopy memo that shares, instead of copying, every tensor (the copy's tables are
    rebound, see `bind`) and every Python module or lock reachable from `root` (an installed
    forward may hold them; they cannot be copied)."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _SHARED):
            memo[id(obj)] = obj
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.FunctionType)):
            stack.extend(vars(obj).values())
    return memo
