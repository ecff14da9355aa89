"""The sharded attention call: the root's heads here, each helper's heads on its GPU, one output.

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
head on the root instead, with one warning per process and plan.

Legend: B batch (1), H heads, S sequence, D head dim, F = H*D; g heads per chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..exchange.streams import Event, Lane, current_stream, on_streams, record, wait
from ..exchange.transport import TransportMode, fetch_chunk, resolve, send_chunk
from ..exchange.workspace import Workspace, WorkspaceKey
from ..kernels import AttentionBackend, attention, get_backend
from . import sizing
from .shard_plan import ShardPlan

log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


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
    """Callable `(q_BHSD, k_BHSD, v_BHSD, *, scale=None) -> out_BSF` over a `ShardPlan`.

    q, k, v: `[1, H, S, D]` on the root (strided views allowed, read only). Returns a new
    `[1, S, H*D]` tensor, equal to the single-GPU call with the same backend (bit-identical for
    a deterministic backend). Calls with S < min_tokens, or a batch above 1, stay on the root.
    """

    def __init__(self, plan: ShardPlan, *, backend: str = "sdpa",
                 transport: TransportMode = TransportMode.AUTO, min_tokens: int = 0,
                 chunk_heads: int = sizing.DEFAULT_CHUNK_HEADS,
                 ring_slots: int = sizing.DEFAULT_RING_SLOTS):
        if chunk_heads < 1 or ring_slots < 1:
            raise ValueError(f"chunk_heads={chunk_heads} and ring_slots={ring_slots} must be >= 1")
        self.plan = plan
        self.backend_name = backend
        self.transport = transport
        self.min_tokens = min_tokens
        self.chunk_heads = chunk_heads
        self.ring_slots = ring_slots
        self._helpers: dict[tuple[torch.device, int], _HelperState] = {}
        self.last_route = "none"  # "split" / "root" / "fallback": what the last call did

    # ------------------------------------------------------------------ public
    def __call__(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                 scale: float | None = None) -> torch.Tensor:
        backend = get_backend(self.backend_name)
        b, heads, seq_len, _ = q_BHSD.shape
        if b != 1 or seq_len < self.min_tokens:
            return self._on_root("root", backend, q_BHSD, k_BHSD, v_BHSD, scale)
        problems = backend.violations(q_BHSD, k_BHSD, v_BHSD)
        if problems:
            raise ValueError(f"attention backend {backend.name!r} cannot run this call: "
                             f"{'; '.join(problems)}; choose another backend (e.g. 'sdpa')")
        if q_BHSD.device != self.plan.root:
            warn_once(self.plan.describe(),
                      f"Dual-Sage root moved: attention runs on {q_BHSD.device}, the plan's root "
                      f"is {self.plan.root}; computing all heads there")
            return self._on_root("root", backend, q_BHSD, k_BHSD, v_BHSD, scale)
        try:
            return self._split(backend, q_BHSD, k_BHSD, v_BHSD, scale)
        except _HelperFailure as exc:
            cause = exc.__cause__
            warn_once(self.plan.describe(),
                      f"Dual-Sage helper failed: {type(cause).__name__}: {cause}; computing all "
                      f"heads on {q_BHSD.device} for this call (plan {self.plan.describe()})")
            return self._on_root("fallback", backend, q_BHSD, k_BHSD, v_BHSD, scale)

    def _on_root(self, route: str, backend, q_BHSD, k_BHSD, v_BHSD, scale) -> torch.Tensor:
        """All heads on the device of the inputs, with the same backend (the exact reference)."""
        self.last_route = route
        return attention(q_BHSD, k_BHSD, v_BHSD, backend=backend.name, scale=scale, output="BSF")

    def status(self) -> str:
        modes = {str(s.lane.helper): s.mode.value for s in self._helpers.values()}
        return (f"heads {self.plan.describe()}, backend {self.backend_name}, transport "
                f"{modes or self.transport.value}, min_tokens {self.min_tokens}")

    # ------------------------------------------------------------------ internals
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
        if state.workspace is not None and state.workspace.key != key:
            state.workspace.release(state.lane)
            state.workspace = None
        if state.workspace is None:
            state.workspace = Workspace.allocate(key, state.lane)
        return state.workspace

    def _drop_workspace(self, state: _HelperState) -> None:
        if state.workspace is not None:
            state.workspace.release(state.lane)
            state.workspace = None

    def _split(self, backend: AttentionBackend, q_BHSD, k_BHSD, v_BHSD, scale) -> torch.Tensor:
        root = q_BHSD.device
        _, heads, seq_len, head_dim = q_BHSD.shape
        ranges = self.plan.ranges_for(heads)
        root_stream = current_stream(root)
        out_BSF = torch.empty(1, seq_len, heads * head_dim, dtype=q_BHSD.dtype, device=root)
        out_SHD = out_BSF.view(seq_len, heads, head_dim)

        # 1. gather every helper's heads (contiguous, chunk-major) on the root's stream
        active: list[tuple[_HelperState, Workspace, int]] = []
        for index, (start, stop) in enumerate(ranges[1:], start=1):
            if stop == start:
                continue
            state = self._helper_state(root, index, self.plan.devices[index])
            key = WorkspaceKey(seq_len, stop - start, head_dim, q_BHSD.dtype,
                               min(self.chunk_heads, stop - start), self.ring_slots,
                               state.mode is TransportMode.HOST)
            try:
                ws = self._workspace(state, key)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                self._drop_workspace(state)
                raise _HelperFailure() from exc
            for a, b in ws.chunks():
                block = ws.send_chunk(a, b)
                for part, src in enumerate((q_BHSD, k_BHSD, v_BHSD)):
                    block[part].copy_(src[0, start + a: start + b])
            active.append((state, ws, start))
        ready = record(root_stream)

        # 2. the root's own heads, queued first so the root GPU starts while the host queues
        # the helpers' work (their copies wait only for `ready`, not for this attention)
        r0, r1 = ranges[0]
        if r1 > r0:
            root_out_BHSD = backend.fn(q_BHSD[:, r0:r1], k_BHSD[:, r0:r1], v_BHSD[:, r0:r1],
                                       scale=scale)
            out_SHD[:, r0:r1].copy_(root_out_BHSD[0].transpose(0, 1))

        # 3. helpers: chunks out, attention there, outputs back (all queued, nothing waits)
        returned: list[tuple[Event, Workspace, int]] = []
        for state, ws, start in active:
            try:
                done = self._launch_helper(backend, state, ws, ready, scale)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                for lane_state, _, _ in active:
                    # later root work (the fallback, the next call's gather into `send`) must
                    # queue behind whatever this call already handed to the side streams
                    for stream in lane_state.lane.root_streams:
                        if stream is not None:
                            root_stream.wait_stream(stream)
                    self._drop_workspace(lane_state)
                raise _HelperFailure() from exc
            returned.append((done, ws, start))

        # 4. each helper's heads into the output once they are back
        for done, ws, start in returned:
            # reading `recv` before the helper's last return landed would copy stale rows
            wait(root_stream, done)
            out_SHD[:, start: start + ws.key.heads].copy_(ws.recv.transpose(0, 1))
        self.last_route = "split"
        return out_BSF

    def _launch_helper(self, backend: AttentionBackend, state: _HelperState, ws: Workspace,
                       ready: Event, scale: float | None) -> Event:
        """Queue one helper's chunks; returns the event after its last output reached the root."""
        lane = state.lane
        # the send buffer is filled by the root's current stream: copying earlier sends garbage
        wait(lane.root_send, ready)
        for chunk, (a, b) in enumerate(ws.chunks()):
            slot = ws.slot(chunk, b - a)
            arrived = send_chunk(state.mode, lane, ws, chunk, slot, ws.send_chunk(a, b))
            # attending before the chunk arrived would read the previous chunk's data
            wait(lane.helper_compute, arrived)
            with on_streams(lane.helper_compute):
                out_BgSD = self._helper_attention(backend, slot, scale)
                slot[0].copy_(out_BgSD[0])  # the output overwrites q, freeing one buffer
            computed = record(lane.helper_compute)
            fetch_chunk(state.mode, lane, ws, chunk, ws.recv[a:b], slot[0], computed)
        return record(lane.root_recv)

    def _helper_attention(self, backend: AttentionBackend, slot_3gSD: torch.Tensor,
                          scale: float | None) -> torch.Tensor:
        """One chunk's attention on the helper (a seam tests use to simulate a failure)."""
        return backend.fn(slot_3gSD[0:1], slot_3gSD[1:2], slot_3gSD[2:3], scale=scale)


class _HelperFailure(Exception):
    """Internal: a helper could not take its share; the cause is chained."""
