"""One DiT block on every GPU, each running upstream's own block on its share of the token rows.

Per block, every share k runs upstream `DiTBlock.forward` (the root through the block-replace
patch's `original_block`, each helper on its own ComfyUI-managed clone of the block) on its
rows, with the per-forward arguments sliced for them by the split plan (`plan.SPLIT_PLAN`): the
residual rows, `mod_segments` clipped and re-based, the RoPE table's rows, a copy of `t_emb`;
the output rows gather back into the model's h (`plan.GATHER_PLAN`). Attention is
the block's only cross-row operation; the block calls it through ComfyUI's
`optimized_attention_override`, where `ShareAttention` does the head all-to-all:

1. buffers: share k allocates, on its device, one [S, 3, g, D] buffer per head chunk it attends
   and one [s_k, g*D] piece per chunk another share returns to it, and posts them.
2. gathers: for each head chunk c of each share j (in the order chunks are attended), k copies
   the q|k|v columns of its rows into one contiguous piece [s_k, 3, g, D] (straight into its own
   buffer when j == k) and sends it on the k -> j link (copy engines, one send stream per link),
   posting the arrival event.
3. attention, chunk by chunk: k's compute stream waits for that chunk's pieces from every other
   share (stream waits, no host synchronisation) and calls the attention function ComfyUI would
   call (a chained override, else the module's preferred attention, else ComfyUI's `func`) on
   q, k, v views [1, g, S, D]; the rows of the output that belong to another share go back on
   the k -> j link while the next chunk is attended.
4. k waits for the returned pieces and hands upstream its rows' output [1, s_k, H*D].

Each share runs on a host thread of its own (`threads.py`: the root share on the model's
thread, helpers on persistent workers carrying the torch state); `threads.Exchange` orders the
host side (an event is always recorded before a stream waits on it) and releases every share
when one fails. Each link is issued by its source share's thread only.

Exactness: every op but attention is per token and runs upstream's code on the share's rows
(row-independent at the row counts where the GEMM kernel does not change, see `split.py`);
attention per head over all S rows is the same computation on the same inputs, so the result
is the single-GPU block's bit for bit.

Legend: S tokens, C hidden, H heads, D head dim, I = H*D, s_k rows of share k, g heads per
chunk. Tensor suffixes name their dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam import clones as comfy_clones
from ..comfy_seam import names
from ..comfy_seam.devices import device_context
from ..comfy_seam.names import OVERRIDE_KEY
from ..exchange.links import Link, keep_until_used
from ..exchange.streams import current_stream, record, wait
from ..exchange.transport import TransportMode
from .plan import (
    GATHER_PLAN,
    INPUTS,
    OUTPUT,
    RESIDUAL,
    SPLIT_PLAN,
    RowSplit,
    Segments,
    helper_share,
    root_share,
)
from .split import SequenceSplit
from .threads import DEFAULT_TIMEOUT_S, Exchange, ShareWorker, run_shares

# one share's block call: (its arguments by `plan.SPLIT_PLAN` key, transformer_options) -> new h
BlockCall = Callable[[dict[str, Any], dict], torch.Tensor]


@dataclass
class DeviceRows:
    """One share of the residual stream and of the per-forward block inputs (by plan key)."""

    device: torch.device
    start: int
    stop: int
    x_sC: torch.Tensor  # the root's: a view of the model's h; a helper's: its own tensor
    inputs: dict[str, Any]  # `plan.INPUTS`: t_emb, mod_segments, rope_freqs of these rows

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def segments(self) -> Segments:
        return self.inputs[names.BLOCK_SEGMENTS]

    def args(self) -> dict[str, Any]:
        """The share's block arguments: its residual rows and its inputs."""
        return {RESIDUAL: self.x_sC, **self.inputs}


@dataclass
class SplitState:
    """The residual stream split over the devices for one forward's block loop."""

    h_SC: torch.Tensor  # the model's residual tensor (root rows live, the others stale)
    shares: list[DeviceRows]
    inputs: tuple[int, ...]  # ids of the `plan.INPUTS` values it was built for
    version: int | None = None
    gathered: bool = False

    def owns(self, h_SC: torch.Tensor, inputs: tuple[Any, ...]) -> bool:
        """True when `h_SC` is the tensor this state returned, untouched since, and the block
        call's inputs (`plan.inputs_of`) are the ones it was built for."""
        return (h_SC is self.h_SC and self.inputs == tuple(id(v) for v in inputs)
                and self.version == tensor_version(h_SC))


def tensor_version(tensor: torch.Tensor) -> int | None:
    # inference tensors keep no version counter (reading it raises)
    return None if tensor.is_inference() else tensor._version


# ComfyUI's kernels and comfy-kitchen use the current device (a module name: tests book by it)
device_current = device_context


class SequenceRunner:
    """Runs DiT blocks split over `split.devices`; owns the links and the share threads."""

    def __init__(self, split: SequenceSplit, transport: TransportMode,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.split = split
        self.transport = transport
        self.timeout_s = timeout_s
        n = len(split.devices)
        # every link exists before any share thread runs: each is then used by one thread
        self.links: dict[tuple[int, int], Link] = {
            (a, b): Link(split.devices[a], split.devices[b], transport)
            for a in range(n) for b in range(n) if a != b}
        self.workers: list[ShareWorker | None] = [None] + [
            ShareWorker(f"h3-sequence-share-{k}") for k in range(1, n)]
        self.attention_calls = 0

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self.split.devices

    def link(self, src: int, dst: int) -> Link:
        return self.links[(src, dst)]

    def transports(self) -> set[str]:
        return {link.mode.value for link in self.links.values()}

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
        for worker in self.workers:
            if worker is not None:
                worker.close()
        self.workers = [None] * len(self.workers)

    # ------------------------------------------------------------------ scatter / gather
    def scatter(self, args: dict[str, Any]) -> SplitState:
        """Split the residual stream and the block inputs over the devices (first block), each
        argument by its `plan.SPLIT_PLAN` spec."""
        h_SC = args[RESIDUAL]
        rows = self.split.rows_for(h_SC.shape[_RESIDUAL_SPEC.dim])
        root = self.devices[0]
        a0, b0 = rows[0]
        root_inputs = {key: root_share(SPLIT_PLAN[key], args[key], a0, b0) for key in INPUTS}
        shares = [DeviceRows(root, a0, b0, _RESIDUAL_SPEC.rows(h_SC, a0, b0), root_inputs)]
        # (device index, destination, source): every source is made contiguous BEFORE the
        # event below, so no copy kernel queued after it can still be writing what a link reads
        sends: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        allocated: dict[int, Any] = {}
        for k in range(1, len(self.devices)):
            a, b = rows[k]
            device = self.devices[k]
            with device_current(device):
                values = {}
                for key, spec in SPLIT_PLAN.items():
                    values[key], copies = helper_share(spec, args[key], a, b, device)
                    sends += [(k, dst, src) for dst, src in copies]
                # the buffers above were allocated on k's compute stream: a link writes them
                # only after what that stream queued before (their memory's last owner) is done
                allocated[k] = record(current_stream(device))
            x_sC = values.pop(RESIDUAL)
            shares.append(DeviceRows(device, a, b, x_sC, values))
        # everything sent below was produced on the root's compute stream
        produced = record(current_stream(root))
        arrived: dict[int, Any] = {}
        for k, dst, src in sends:
            arrived[k] = self._send(0, k, dst, src, produced, allocated[k])
        for k, event in arrived.items():
            with device_current(self.devices[k]):
                # k's first kernels read these: they must have arrived (one receive stream, in
                # order, so the last arrival covers every copy to k)
                wait(current_stream(self.devices[k]), event)
        return SplitState(h_SC, shares, tuple(id(args[key]) for key in INPUTS))

    def _send(self, src: int, dst: int, dst_tensor: torch.Tensor, src_tensor: torch.Tensor,
              after: Any, dst_ready: Any) -> Any:
        """One contiguous copy on the src -> dst link; both tensors kept until it completed."""
        link = self.link(src, dst)
        arrived = link.copy(dst_tensor, src_tensor, after=after, dst_ready=dst_ready)
        keep_until_used(src_tensor, link.send)
        keep_until_used(dst_tensor, link.recv)
        return arrived

    def gather(self, state: SplitState) -> torch.Tensor:
        """Bring every helper's rows back into the root's h (last block, or before foreign code)."""
        if state.gathered:
            return state.h_SC
        root = self.devices[0]
        # h's helper rows are not touched on the root after the scatter; ordering the writes
        # after the root's queued work anyway costs nothing (the root waits for them next)
        root_ready = record(current_stream(root))
        arrivals = []
        for k, share in enumerate(state.shares[1:], start=1):
            with device_current(share.device):
                # the rows are final only after k's last block kernels
                done = record(current_stream(share.device))
            into = _GATHER.rows(state.h_SC, share.start, share.stop)
            arrivals.append(self._send(k, 0, into, share.x_sC, done, root_ready))
        for arrived in arrivals:
            # the root reads h next: every helper's rows must have landed
            wait(current_stream(root), arrived)
        state.gathered = True
        state.version = tensor_version(state.h_SC)
        return state.h_SC

    # ------------------------------------------------------------------ one block
    def run_block(self, state: SplitState, calls: list[BlockCall], transformer_options: dict,
                  blocks: list[torch.nn.Module]) -> None:
        """One block on every share (`calls[k]` runs upstream's block on share k's rows,
        `blocks[k]` is the module it runs), updating each share's residual rows."""
        seq_len = state.h_SC.shape[0]
        state.gathered = False
        exchange = Exchange(self.timeout_s)
        previous = transformer_options.get(OVERRIDE_KEY)
        jobs = []
        for k, share in enumerate(state.shares):
            # the attention ComfyUI would run is the root module's choice (a preferred
            # attention set on the root's modules is not on a helper clone's)
            override = ShareAttention(self, state, exchange, k, seq_len, previous, blocks[0])
            options = {**transformer_options, OVERRIDE_KEY: override}
            jobs.append(_job(calls[k], share, options, override))
        try:
            outs = run_shares(self.workers, jobs, self.devices, exchange)
        finally:
            self._replace_stuck_workers()
        for share, out in zip(state.shares, outs, strict=True):
            if out is not share.x_sC:
                if share is state.shares[0]:
                    share.x_sC.copy_(out)  # the root's rows live in the model's h
                else:
                    share.x_sC = out
        state.version = tensor_version(state.h_SC)

    def _replace_stuck_workers(self) -> None:
        for k, worker in enumerate(self.workers):
            if worker is not None and worker.busy:
                # past the timeout: its call may still finish some day; the next block gets a
                # fresh thread instead of queueing behind it
                self.workers[k] = ShareWorker(f"h3-sequence-share-{k}")


_RESIDUAL_SPEC = SPLIT_PLAN[RESIDUAL]
assert isinstance(_RESIDUAL_SPEC, RowSplit)
# the output is gathered where the residual came from: the model loop hands it on
_GATHER = RowSplit(GATHER_PLAN[OUTPUT].dim, _RESIDUAL_SPEC.expected_dims)


def _job(call: BlockCall, share: DeviceRows, options: dict,
         override: ShareAttention) -> Callable[[], torch.Tensor]:
    def job() -> torch.Tensor:
        with device_current(share.device):
            out = call(share.args(), options)
        if not override.called:
            raise RuntimeError("sequence parallel: the block returned without calling "
                               "attention through transformer_options' override; it cannot "
                               "be split by rows")
        return out
    return job


class ShareAttention:
    """The attention override one share's block call sees: the head all-to-all (module doc)."""

    def __init__(self, runner: SequenceRunner, state: SplitState, exchange: Exchange, k: int,
                 seq_len: int, previous: Any, block: torch.nn.Module):
        self.runner = runner
        self.state = state
        self.exchange = exchange
        self.k = k
        self.seq_len = seq_len
        self.previous = previous  # chained override (Dual-Sage's steps aside under sequence)
        self.block = block
        self.called = False

    def __call__(self, func: Callable, q: torch.Tensor, k_: torch.Tensor, v: torch.Tensor,
                 heads: int, **kwargs: Any) -> torch.Tensor:
        share = self.state.shares[self.k]
        if self.called or q.shape[1] != self.runner.split.heads or q.shape[2] != share.rows:
            raise RuntimeError(f"sequence parallel: an attention call of {tuple(q.shape)} on "
                               f"share {self.k} ({share.rows} rows, {self.runner.split.heads} "
                               "heads) is not the block's one self-attention")
        self.called = True
        self.runner.attention_calls += 1
        return self._exchange(func, q, k_, v, heads, kwargs)

    def _attend(self, func: Callable, q_BgSD: torch.Tensor, k_BgSD: torch.Tensor,
                v_BgSD: torch.Tensor, g: int, kwargs: dict) -> torch.Tensor:
        """The attention function ComfyUI would call on these heads (its override chain if
        one is installed, else the module's preferred attention, else `func`)."""
        if self.previous is not None:
            return self.previous(func, q_BgSD, k_BgSD, v_BgSD, g, **kwargs)
        preferred = getattr(getattr(self.block.attn, "comfy_attention", None), "function", None)
        if preferred is not None:
            wrap = comfy_clones.container(self.block)
            return preferred(wrap(q_BgSD), wrap(k_BgSD), wrap(v_BgSD), g, **kwargs)
        return func(q_BgSD, k_BgSD, v_BgSD, g, **kwargs)

    def _exchange(self, func: Callable, q_BHsD: torch.Tensor, k_BHsD: torch.Tensor,
                  v_BHsD: torch.Tensor, heads: int, kwargs: dict) -> torch.Tensor:
        runner, ex, me = self.runner, self.exchange, self.k
        shares = self.state.shares
        share = shares[me]
        device, s, head_dim = share.device, share.rows, q_BHsD.shape[-1]
        dtype, n = q_BHsD.dtype, len(shares)
        chunks, order = runner.split.attention_plan(self.seq_len)
        compute = current_stream(device)

        # 1. buffers: what the others write into on this device
        dest = [torch.empty((self.seq_len, 3, h1 - h0, head_dim), dtype=dtype, device=device)
                for h0, h1 in chunks[me]]
        recv = {(j, c): torch.empty((s, (h1 - h0) * head_dim), dtype=dtype, device=device)
                for j in range(n) if j != me for c, (h0, h1) in enumerate(chunks[j])}
        out_sI = torch.empty((s, heads * head_dim), dtype=dtype, device=device)
        # links write these: only after the memory's last owner's kernels on this device
        ex.post(("buffers", me), (dest, recv, record(compute)))

        # 2. gathers: this share's rows of every chunk; pieces leave as soon as gathered
        qkv = (q_BHsD[0].transpose(0, 1), k_BHsD[0].transpose(0, 1), v_BHsD[0].transpose(0, 1))
        sent = []
        for j, c in order:
            h0, h1 = chunks[j][c]
            if j == me:
                target = dest[c][share.start:share.stop]
                for i, t_sHD in enumerate(qkv):
                    target[:, i].copy_(t_sHD[:, h0:h1])
                continue
            piece = torch.empty((s, 3, h1 - h0, head_dim), dtype=dtype, device=device)
            for i, t_sHD in enumerate(qkv):
                piece[:, i].copy_(t_sHD[:, h0:h1])
            gathered = record(compute)
            dest_j, _, ready_j = ex.take(("buffers", j))
            arrived = runner._send(me, j, dest_j[c][share.start:share.stop], piece, gathered,
                                   ready_j)
            ex.post(("qkv", j, c, me), arrived)
            sent.append(piece)
        # the links keep the pieces until sent (`keep_until_used`: on a GPU their memory is
        # not reused before the copies ran, so all of them count); held past attention they
        # would stay through the MLP
        sent = piece = None
        del qkv, q_BHsD, k_BHsD, v_BHsD

        # 3. attention, chunk by chunk; other shares' rows go back while the next one runs
        for c, (h0, h1) in enumerate(chunks[me]):
            for other in range(n):
                if other != me:
                    # attending before that share's rows of this chunk landed reads garbage
                    wait(compute, ex.take(("qkv", me, c, other)))
            buf = dest[c]
            q_c, k_c, v_c = (buf[:, i].transpose(0, 1).unsqueeze(0) for i in range(3))
            out = self._attend(func, q_c, k_c, v_c, h1 - h0, kwargs)
            out_SG = out.reshape(self.seq_len, -1)
            # links move contiguous rows only (a view here would make the return a gather)
            out_SG = out_SG if out_SG.is_contiguous() else out_SG.contiguous()
            out_sI[:, h0 * head_dim:h1 * head_dim].copy_(out_SG[share.start:share.stop])
            done = record(compute)
            for other in range(n):
                if other == me:
                    continue
                _, recv_o, ready_o = ex.take(("buffers", other))
                rows = shares[other]
                ret = runner._send(me, other, recv_o[(me, c)], out_SG[rows.start:rows.stop],
                                   done, ready_o)
                ex.post(("returned", other, me, c), ret)
            # this chunk's buffer is free once attended (marked for the link streams)
            dest[c] = None  # type: ignore[call-overload]
            del out, out_SG, buf, q_c, k_c, v_c

        # 4. the returned rows of the other shares' heads
        for j in range(n):
            if j == me:
                continue
            for c, (h0, h1) in enumerate(chunks[j]):
                # the returned rows are read next: they must have arrived
                wait(compute, ex.take(("returned", me, j, c)))
                out_sI[:, h0 * head_dim:h1 * head_dim].copy_(recv.pop((j, c)))
        return out_sI.unsqueeze(0)
