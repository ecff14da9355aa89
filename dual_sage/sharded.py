"""The sharded attention call: the root's heads here, each helper's heads on its GPU, one output.

The attention itself is the caller's `attend(q, k, v)` (ComfyUI's function, or an explicitly
chosen kernel), run once per head subset, so a split call equals the whole call bit for bit
whenever that function treats heads independently (see `common.exactness`).

Order of one call (no host synchronisation; streams and events only):
1. root current stream: gather each helper's heads of q, k, v into a contiguous chunk-major
   send buffer (before the root's attention, so the copy kernel does not fight it for SMs),
   then record `ready`;
2. root current stream: the root's own heads, written into the output;
3. meanwhile, per helper, per chunk of g heads: the copy engines move the chunk into a ring
   slot (`send_chunk`), the helper attends it on its compute stream as soon as it arrived, and
   the output goes back into the root's receive buffer (`fetch_chunk`);
4. root current stream waits for each helper's last return and writes its heads into the output.

A helper failure (out of memory, a runtime error on the helper) makes that call compute every
head on the root instead, with one warning per process and plan. The failure is remembered for
that call shape until `release()` (ComfyUI's cleanup after each sampling run, or an unload): the
rest of the run skips the gather, the allocation and the failure, and the next run retries once
(memory freed in between, e.g. a text encoder released from the helper, lets it succeed).

Legend: B batch (1), H heads, S sequence, D head dim, F = H*D; g heads per chunk.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..common.exactness import ExactRange
from ..exchange.streams import (
    Event,
    Lane,
    current_stream,
    fresh,
    host_continues,
    launch,
    record,
    wait,
)
from ..exchange.transport import TransportMode, fetch_chunk, resolve, send_chunk
from ..exchange.workspace import Workspace, WorkspaceKey
from . import sizing
from .shard_plan import ShardPlan

log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(q_BhSD, k_BhSD, v_BhSD) -> out_BhSD (a view is fine) for any head subset h."""


def warn_once(key: str, message: str) -> None:
    """logging.warning once per process for each (plan, kind of event)."""
    tag = (key, message.split(":")[0])
    if tag not in _warned:
        _warned.add(tag)
        log.warning(message)


@dataclass
class _HelperState:
    lane: Lane
    mode: TransportMode
    workspace: Workspace | None = None


class ShardedAttention:
    """Callable `(q_BHSD, k_BHSD, v_BHSD, attend) -> out_BSF` over a `ShardPlan`.

    q, k, v: `[1, H, S, D]` on the root (strided views allowed, read only). Returns a new
    `[1, S, H*D]` tensor equal to `attend` over all heads on the root whenever `attend` treats
    heads independently. Calls with S < min_tokens, a batch above 1, or a split outside
    `exact_range` (None: no limit) stay on the root. `routes` counts what each call did.
    """

    def __init__(self, plan: ShardPlan, *, transport: TransportMode = TransportMode.AUTO,
                 min_tokens: int = 0, chunk_heads: int = sizing.DEFAULT_CHUNK_HEADS,
                 ring_slots: int = sizing.DEFAULT_RING_SLOTS,
                 exact_range: ExactRange | None = None):
        if chunk_heads < 1 or ring_slots < 1:
            raise ValueError(f"chunk_heads={chunk_heads} and ring_slots={ring_slots} must be >= 1")
        self.plan = plan
        self.transport = transport
        self.min_tokens = min_tokens
        self.chunk_heads = chunk_heads
        self.ring_slots = ring_slots
        self.exact_range = exact_range
        self._helpers: dict[tuple[torch.device, int], _HelperState] = {}
        self._failed: dict[tuple, str] = {}
        self.routes: Counter[str] = Counter()
        self.workspace_allocations = 0
        self.last_route = "none"  # "split" / "root" / "inexact" / "fallback"

    # ------------------------------------------------------------------ public
    def __call__(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                 attend: Attend) -> torch.Tensor:
        b, heads, seq_len, head_dim = q_BHSD.shape
        if b != 1 or seq_len < self.min_tokens:
            return self._on_root("root", attend, q_BHSD, k_BHSD, v_BHSD)
        if q_BHSD.device != self.plan.root:
            warn_once(self.plan.describe(),
                      f"Dual-Sage root moved: attention runs on {q_BHSD.device}, the plan's root "
                      f"is {self.plan.root}; computing all heads there")
            return self._on_root("root", attend, q_BHSD, k_BHSD, v_BHSD)
        ranges = self.plan.ranges_for(heads)
        if ranges[0] == (0, heads):  # a head group too small to give a helper any head
            return self._on_root("root", attend, q_BHSD, k_BHSD, v_BHSD)
        chunks = self._exact_chunks(ranges, seq_len, q_BHSD.dtype, head_dim)
        if chunks is None:
            return self._on_root("inexact", attend, q_BHSD, k_BHSD, v_BHSD)
        shape = (seq_len, heads, head_dim, q_BHSD.dtype)
        if shape in self._failed:
            return self._on_root("fallback", attend, q_BHSD, k_BHSD, v_BHSD)
        try:
            return self._split(attend, q_BHSD, k_BHSD, v_BHSD, ranges, chunks)
        except _HelperFailure as exc:
            cause = exc.__cause__
            self._failed[shape] = f"{type(cause).__name__}: {cause}"
            warn_once(self.plan.describe(),
                      f"Dual-Sage helper failed: {type(cause).__name__}: {cause}; computing all "
                      f"heads on {q_BHSD.device} for calls of {seq_len} tokens until this "
                      f"sampling run ends (plan {self.plan.describe()})")
            return self._on_root("fallback", attend, q_BHSD, k_BHSD, v_BHSD)

    def release(self) -> None:
        """Free every workspace and forget remembered failures (ComfyUI cleanup / unload)."""
        for state in self._helpers.values():
            self._drop_workspace(state)
        self._failed.clear()

    def workspace_bytes(self) -> int:
        return sum(s.workspace.nbytes() for s in self._helpers.values()
                   if s.workspace is not None)

    def status(self) -> str:
        modes = {str(s.lane.helper): s.mode.value for s in self._helpers.values()}
        return (f"heads {self.plan.describe()}, transport {modes or self.transport.value}, "
                f"min_tokens {self.min_tokens}, calls {dict(self.routes)}")

    def __deepcopy__(self, memo) -> ShardedAttention:
        return self  # one runtime (streams, buffers) per model, shared by every clone

    # ------------------------------------------------------------------ internals
    def _on_root(self, route: str, attend: Attend, q_BHSD, k_BHSD, v_BHSD) -> torch.Tensor:
        """All heads on the device of the inputs, with the same function (the exact reference)."""
        self.last_route = route
        self.routes[route] += 1
        b, heads, seq_len, head_dim = q_BHSD.shape
        return attend(q_BHSD, k_BHSD, v_BHSD).transpose(1, 2).reshape(b, seq_len,
                                                                      heads * head_dim)

    def _exact_chunks(self, ranges, seq_len: int, dtype: torch.dtype, head_dim: int
                      ) -> tuple[int, ...] | None:
        """Heads per chunk on each device that keep every per-GPU call exact (None: the call
        stays whole). A helper's chunks are at least `chunk_heads`, and none, the last one
        included, is smaller than the range asks for."""
        chunks = []
        for device, (start, stop) in zip(self.plan.devices, ranges, strict=True):
            heads = stop - start
            if heads == 0:  # a device without heads in this call (a small head group)
                chunks.append(0)
                continue
            need = 1 if self.exact_range is None else \
                self.exact_range.min_heads(device, seq_len, dtype, head_dim)
            if need is None or heads < need:
                return None
            chunks.append(_chunk_at_least(heads, max(self.chunk_heads, need), need))
        return tuple(chunks)

    def _helper_state(self, root: torch.device, index: int, helper: torch.device
                      ) -> _HelperState:
        key = (root, index)
        state = self._helpers.get(key)
        if state is None:
            state = _HelperState(lane=Lane.create(root, helper),
                                 mode=resolve(self.transport, root, helper))
            self._helpers[key] = state
        return state

    def _workspace(self, state: _HelperState, key: WorkspaceKey) -> Workspace:
        old = state.workspace
        if old is not None and old.fits(key):
            return old.use(key)
        new = Workspace.allocate(key, state.lane, grow=old)
        self.workspace_allocations += 1
        if old is not None:
            old.release(state.lane)
        state.workspace = new
        return new

    def _drop_workspace(self, state: _HelperState) -> None:
        if state.workspace is not None:
            state.workspace.release(state.lane)
            state.workspace = None

    def _split(self, attend: Attend, q_BHSD, k_BHSD, v_BHSD, ranges, chunks: tuple[int, ...]
               ) -> torch.Tensor:
        root = q_BHSD.device
        _, heads, seq_len, head_dim = q_BHSD.shape
        root_stream = current_stream(root)
        out_BSF = fresh(torch.empty(1, seq_len, heads * head_dim, dtype=q_BHSD.dtype,
                                    device=root))
        out_SHD = out_BSF.view(seq_len, heads, head_dim)

        # 1. gather every helper's heads (contiguous, chunk-major) on the root's stream
        active: list[tuple[_HelperState, Workspace, int]] = []
        for index, (start, stop) in enumerate(ranges[1:], start=1):
            if stop == start:
                continue
            state = self._helper_state(root, index, self.plan.devices[index])
            key = WorkspaceKey(seq_len, stop - start, head_dim, q_BHSD.dtype,
                               chunks[index], self.ring_slots,
                               state.mode is TransportMode.HOST)
            try:
                ws = self._workspace(state, key)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                self._drop_workspace(state)
                raise _HelperFailure() from exc
            launch((root_stream,), functools.partial(_gather, ws, start, q_BHSD, k_BHSD, v_BHSD))
            active.append((state, ws, start))
        ready = record(root_stream)

        # 2. the root's own heads, queued first so the root GPU starts while the host queues
        # the helpers' work (their copies wait only for `ready`, not for this attention)
        r0, r1 = ranges[0]
        if r1 > r0:
            launch((root_stream,), functools.partial(
                _attend_into, out_SHD[:, r0:r1], attend, q_BHSD[:, r0:r1], k_BHSD[:, r0:r1],
                v_BHSD[:, r0:r1]))

        # 3. helpers: chunks out, attention there, outputs back (all queued, nothing waits).
        # On a failure the buffers are released with record_stream, so the work this call
        # already queued on the side streams finishes on memory nobody else gets meanwhile.
        returned: list[tuple[Event, Workspace, int]] = []
        for state, ws, start in active:
            try:
                done = self._launch_helper(attend, state, ws, ready)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                for lane_state, _, _ in active:
                    self._drop_workspace(lane_state)
                raise _HelperFailure() from exc
            returned.append((done, ws, start))

        # 4. each helper's heads into the output once they are back
        for done, ws, start in returned:
            # reading `recv` before the helper's last return landed would copy stale rows
            wait(root_stream, done)
            launch((root_stream,), functools.partial(
                _copy_heads, out_SHD[:, start: start + ws.key.heads], ws.recv))
        host_continues(root_stream)
        self.last_route = "split"
        self.routes["split"] += 1
        return out_BSF

    def _launch_helper(self, attend: Attend, state: _HelperState, ws: Workspace,
                       ready: Event) -> Event:
        """Queue one helper's chunks; returns the event after its last output reached the root."""
        lane = state.lane
        # the send buffer is filled by the root's current stream: copying earlier sends garbage
        wait(lane.root_send, ready)
        for chunk, (a, b) in enumerate(ws.chunks()):
            slot = ws.slot(chunk, b - a)
            arrived = send_chunk(state.mode, lane, ws, chunk, slot, ws.send_chunk(a, b))
            # attending before the chunk arrived would read the previous chunk's data
            wait(lane.helper_compute, arrived)
            launch((lane.helper_compute,),
                   functools.partial(self._helper_attention, attend, slot))
            computed = record(lane.helper_compute)
            fetch_chunk(state.mode, lane, ws, chunk, ws.recv[a:b], slot[0], computed)
        return record(lane.root_recv)

    def _helper_attention(self, attend: Attend, slot_3gSD: torch.Tensor) -> None:
        """One chunk's attention on the helper; the output overwrites the chunk's q (a seam
        tests use to simulate a failure)."""
        _attend_into(slot_3gSD[0].transpose(0, 1), attend, slot_3gSD[0:1], slot_3gSD[1:2],
                     slot_3gSD[2:3])


def _chunk_at_least(heads: int, start: int, need: int) -> int:
    """The smallest chunk size >= start splitting `heads` into chunks of at least `need`."""
    chunk = max(1, min(start, heads))
    while heads % chunk and heads % chunk < need:
        chunk += 1
    return chunk


def _gather(ws: Workspace, start: int, q_BHSD, k_BHSD, v_BHSD) -> None:
    for a, b in ws.chunks():
        block = ws.send_chunk(a, b)
        for part, src in enumerate((q_BHSD, k_BHSD, v_BHSD)):
            block[part].copy_(src[0, start + a: start + b])


def _attend_into(out_ShD: torch.Tensor, attend: Attend, q, k, v) -> None:
    """out[s, h, d] = attend(q, k, v)[0, h, s, d]."""
    out_ShD.copy_(attend(q, k, v)[0].transpose(0, 1))


def _copy_heads(out_ShD: torch.Tensor, recv_hSD: torch.Tensor) -> None:
    out_ShD.copy_(recv_hSD.transpose(0, 1))


class _HelperFailure(Exception):
    """Internal: a helper could not take its share; the cause is chained."""
