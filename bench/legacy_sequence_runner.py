"""The sequence runner before it ran upstream's block per share (bench_sequence_block.py only).

It re-states the block and is not product code; kept to time today's runner against it.

One DiT block on every GPU, each on its share of the token rows; heads exchanged for attention.

Per block, queued by the one host thread in an order where every event is recorded before any
stream waits on it (a wait on a never-recorded CUDA event would be a no-op):

1. rows, on each device k (device current, the block's tensors bound to k's copy):
   modulation, norm1, qkv_proj on its s_k rows, q/k RMSNorm + RoPE in place, then the gathers:
   for each head chunk c of each device j, the strided q|k|v columns of its rows are copied into
   one contiguous piece [s_k, 3, g, D] (straight into j's attention buffer when j == k), each
   piece recorded by an event. These copy kernels run before any attention on k, so they never
   compete with it for SMs. Right after its gathers, k's pieces leave on the k -> j links (copy
   engines, one send stream per link), chunk by chunk in the order the chunks are attended.
2. attention, on each device j, chunk by chunk: its compute stream waits for that chunk's pieces
   from every other device (stream waits, no host synchronisation) and calls the attention
   function ComfyUI would call (`optimized_attention` of the H3 module, with the block's
   preferred attention and the forward's transformer_options: overrides, backends and flags all
   apply) on q, k, v views `[1, g, S, D]` of the chunk buffer `[S, 3, g, D]`. The rows of the
   output `[S, g*D]` that belong to another device go back on the j -> k link while the next
   chunk is attended; j's own rows are copied into its output on its compute stream.
3. rows again, on each device k: wait for the returned pieces, assemble the attention output
   [s_k, I], then out_proj, gate, norm2, modulation, MLP, gate, in place on k's residual rows.

Exactness: every op of phases 1 and 3 is per token (row-independent at the row counts where the
GEMM kernel does not change, see `split.py`) and attention per head over all S rows is the same
computation on the same inputs, so the result is the single-GPU block's bit for bit.

Buffers are allocated per block from each device's caching allocator on its compute stream and
marked with `record_stream` for the link streams that also touch them, so the allocator reuses
their memory only after those copies completed; between blocks only the residual rows live.

Legend: S tokens, C hidden, H heads, D head dim, I = H*D, s_k rows of device k, g heads per
chunk. Tensor suffixes name their dims.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..chunking.sizing import row_chunks
from ..exchange.links import Link, keep_until_used
from ..exchange.streams import current_stream, record, wait
from ..exchange.transport import TransportMode
from ..guard.device import device_context
from ..sequence.runner import clip_segments
from ..sequence.split import SequenceSplit
from ..sequence.weights import HelperWeights
from .legacy_h3_ops import H3Ops, project_rows

Segments = list[tuple[int, int, Any]]


@dataclass
class DeviceRows:
    """One device's share of the residual stream and of the per-forward block inputs."""

    device: torch.device
    start: int
    stop: int
    x_sC: torch.Tensor  # the root's: a view of the model's h; a helper's: its own tensor
    t_emb: torch.Tensor
    rope: torch.Tensor  # [1, s, 1, r/2, 2, 2]
    segments: Segments

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass
class SplitState:
    """The residual stream split over the devices for one forward's block loop."""

    h_SC: torch.Tensor  # the model's residual tensor (root rows live, the others stale)
    shares: list[DeviceRows]
    inputs: tuple[int, int, int]  # ids of (t_emb, rope_freqs, mod_segments) it was built for
    version: int | None = None
    gathered: bool = False

    def owns(self, h_SC: torch.Tensor, t_emb: Any, rope: Any, segments: Any) -> bool:
        """True when `h_SC` is the tensor this state returned, untouched since."""
        return (h_SC is self.h_SC and self.inputs == (id(t_emb), id(rope), id(segments))
                and self.version == tensor_version(h_SC))


def tensor_version(tensor: torch.Tensor) -> int | None:
    # inference tensors keep no version counter (reading it raises)
    return None if tensor.is_inference() else tensor._version


# ComfyUI's kernels and comfy-kitchen use the current device (a module name: tests book by it)
device_current = device_context


class SequenceRunner:
    """Runs DiT blocks split over `split.devices`; owns the links between them."""

    def __init__(self, split: SequenceSplit, transport: TransportMode,
                 helper_weights: dict[int, HelperWeights]):
        self.split = split
        self.transport = transport
        self.helper_weights = helper_weights  # device index (>= 1) -> its weights
        self.links: dict[tuple[int, int], Link] = {}

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self.split.devices

    def link(self, src: int, dst: int) -> Link:
        key = (src, dst)
        if key not in self.links:
            self.links[key] = Link(self.devices[src], self.devices[dst], self.transport)
        return self.links[key]

    def transports(self) -> set[str]:
        n = len(self.devices)
        return {self.link(a, b).mode.value for a in range(n) for b in range(n) if a != b}

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}

    # ------------------------------------------------------------------ scatter / gather
    def scatter(self, h_SC: torch.Tensor, t_emb: torch.Tensor, rope: torch.Tensor,
                segments: Segments) -> SplitState:
        """Split the residual stream and the block inputs over the devices (first block)."""
        rows = self.split.rows_for(h_SC.shape[0])
        root = self.devices[0]
        t_emb = t_emb.contiguous()
        shares = [DeviceRows(root, rows[0][0], rows[0][1], h_SC[rows[0][0]:rows[0][1]], t_emb,
                             rope[:, rows[0][0]:rows[0][1]], clip_segments(segments, *rows[0]))]
        # (device index, destination, source): every source is made contiguous BEFORE the
        # event below, so no copy kernel queued after it can still be writing what a link reads
        sends: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        allocated: dict[int, Any] = {}
        for k in range(1, len(self.devices)):
            a, b = rows[k]
            device = self.devices[k]
            with device_current(device):
                x_sC = torch.empty((b - a, h_SC.shape[1]), dtype=h_SC.dtype, device=device)
                t_k = torch.empty_like(t_emb, device=device)
                rope_k = torch.empty((1, b - a, *rope.shape[2:]), dtype=rope.dtype, device=device)
                sends += [(k, x_sC, h_SC[a:b]), (k, t_k, t_emb),
                          (k, rope_k, rope[:, a:b].contiguous())]
                seg_k = []
                for s0, s1, row in clip_segments(segments, a, b):
                    if isinstance(row, torch.Tensor):
                        row_k = torch.empty(row.shape, dtype=row.dtype, device=device)
                        sends.append((k, row_k, row.contiguous()))
                        row = row_k
                    seg_k.append((s0, s1, row))
                # the buffers above were allocated on k's compute stream: a link writes them
                # only after what that stream queued before (their memory's last owner) is done
                allocated[k] = record(current_stream(device))
            shares.append(DeviceRows(device, a, b, x_sC, t_k, rope_k, seg_k))
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
        return SplitState(h_SC, shares, (0, 0, 0))

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
            arrivals.append(self._send(k, 0, state.h_SC[share.start:share.stop], share.x_sC,
                                       done, root_ready))
        for arrived in arrivals:
            # the root reads h next: every helper's rows must have landed
            wait(current_stream(root), arrived)
        state.gathered = True
        state.version = tensor_version(state.h_SC)
        return state.h_SC

    # ------------------------------------------------------------------ one block
    @contextlib.contextmanager
    def on_device(self, k: int, index: int) -> Iterator[None]:
        """Device k current and, on a helper, block `index`'s tensors bound to k's copy."""
        with device_current(self.devices[k]):
            if k == 0:
                yield
                return
            with self.helper_weights[k].use(index):
                yield

    def run_block(self, state: SplitState, index: int, block: torch.nn.Module,
                  transformer_options: dict, chunked: Any = None) -> None:
        """Block `index` on every device, updating each device's residual rows in place."""
        ops = H3Ops.for_block(block)
        attn = block.attn
        heads, head_dim = attn.heads, attn.head_dim
        inner = heads * head_dim
        seq_len = state.h_SC.shape[0]
        n = len(self.devices)
        chunks, order = self.split.attention_plan(seq_len)
        shares = state.shares
        state.gathered = False

        for k in range(1, n):
            with device_current(self.devices[k]):
                self.helper_weights[k].begin(index)

        # every device's attention buffers: one [S, 3, g, D] per chunk it attends
        dest: list[list[torch.Tensor]] = []
        dest_ready: list[Any] = []
        for j in range(n):
            with device_current(self.devices[j]):
                dest.append([torch.empty((seq_len, 3, h1 - h0, head_dim), dtype=state.h_SC.dtype,
                                         device=self.devices[j]) for h0, h1 in chunks[j]])
                # links write these: only after the memory's last owner's kernels on j
                dest_ready.append(record(current_stream(self.devices[j])))

        # 1. rows: projections, RoPE, gathers; pieces leave as soon as they are gathered
        mods: list[tuple[torch.Tensor, ...]] = []
        sizes: list[tuple[int, int]] = []
        arrived: dict[tuple[int, int, int], Any] = {}
        for k, share in enumerate(shares):
            with self.on_device(k, index):
                rows = _row_chunks(chunked, share.x_sC)
                sizes.append(rows)
                qkv_chunk, qkv_floor = rows[1]
                mod = block.adaln_proj(share.t_emb)
                mods.append(mod)
                h_sC = ops.mod_scale_shift(block.norm1(share.x_sC), mod[0], mod[1],
                                           share.segments)
                qkv_sN = project_rows(attn.qkv_proj, h_sC, qkv_chunk, qkv_floor)
                del h_sC  # consumed: free it before the attention buffers fill
                s = share.rows
                q = qkv_sN[:, :inner].view(1, s, heads, head_dim)
                k_ = qkv_sN[:, inner:2 * inner].view(1, s, heads, head_dim)
                ops.rms_rope_(q, k_, share.rope, ops.norm_weight(attn.q_norm.weight, share.device),
                              ops.norm_weight(attn.k_norm.weight, share.device), attn.q_norm.eps,
                              share.rope.shape[-3] * 2)
                qkv_s3HD = qkv_sN.view(s, 3, heads, head_dim)
                compute = current_stream(share.device)
                pieces = []
                for j, c in order:
                    h0, h1 = chunks[j][c]
                    if j == k:
                        dest[k][c][share.start:share.stop].copy_(qkv_s3HD[:, :, h0:h1])
                        continue
                    piece = torch.empty((s, 3, h1 - h0, head_dim), dtype=qkv_sN.dtype,
                                        device=share.device)
                    piece.copy_(qkv_s3HD[:, :, h0:h1])
                    pieces.append((j, c, piece, record(compute)))
                del qkv_sN, q, k_, qkv_s3HD
            for j, c, piece, gathered in pieces:
                arrived[(j, c, k)] = self._send(k, j, dest[j][c][share.start:share.stop], piece,
                                                gathered, dest_ready[j])
            # the links keep the pieces until sent (`keep_until_used`); a reference here would
            # hold the last device's [s, 3, H - h, D] pieces through attention and the MLP
            # (measured: the helper's peak 0.69 GiB above the model at S = 68,706)
            pieces = piece = None

        # where each device's attention output lands: its own [s, I] and the returned pieces
        outs: list[torch.Tensor | None] = []
        recv: dict[tuple[int, int, int], torch.Tensor] = {}
        recv_ready: list[Any] = []
        for k, share in enumerate(shares):
            with device_current(share.device):
                outs.append(torch.empty((share.rows, inner), dtype=state.h_SC.dtype,
                                        device=share.device))
                for j in range(n):
                    if j != k:
                        for c, (h0, h1) in enumerate(chunks[j]):
                            recv[(k, j, c)] = torch.empty((share.rows, (h1 - h0) * head_dim),
                                                          dtype=state.h_SC.dtype,
                                                          device=share.device)
                # links write the returned pieces: only after the memory's last owner is done
                recv_ready.append(record(current_stream(share.device)))

        # 2. attention, chunk by chunk; other devices' rows go back while the next chunk runs
        returned: dict[tuple[int, int, int], Any] = {}
        for j, share in enumerate(shares):
            with device_current(share.device):
                compute = current_stream(share.device)
                for c, (h0, h1) in enumerate(chunks[j]):
                    for k in range(n):
                        if k != j:
                            # attending before k's rows of this chunk landed reads garbage
                            wait(compute, arrived[(j, c, k)])
                    buf = dest[j][c]
                    out_SG = self._attend(ops, attn, buf, h1 - h0, transformer_options)
                    outs[j][:, h0 * head_dim:h1 * head_dim].copy_(out_SG[share.start:share.stop])
                    done = record(compute)
                    for k, other in enumerate(shares):
                        if k == j:
                            continue
                        returned[(k, j, c)] = self._send(j, k, recv[(k, j, c)],
                                                         out_SG[other.start:other.stop], done,
                                                         recv_ready[k])
                    # this chunk's buffer is free once attended (marked for the link streams)
                    dest[j][c] = None  # type: ignore[call-overload]
                    del out_SG, buf

        # 3. rows again: assemble the attention output, out_proj, gates, MLP
        for k, share in enumerate(shares):
            with self.on_device(k, index):
                compute = current_stream(share.device)
                for j in range(n):
                    if j == k:
                        continue
                    for c, (h0, h1) in enumerate(chunks[j]):
                        # the returned rows are read next: they must have arrived
                        wait(compute, returned[(k, j, c)])
                        outs[k][:, h0 * head_dim:h1 * head_dim].copy_(recv.pop((k, j, c)))
                (ffn_chunk, ffn_floor), (qkv_chunk, qkv_floor) = sizes[k]
                _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[k]
                _gated_rows(ops, share.x_sC, gate_msa, attn.out_proj, outs[k], share.segments,
                            qkv_chunk, qkv_floor)
                outs[k] = None
                h_sC = ops.mod_scale_shift(block.norm2(share.x_sC), shift_mlp, scale_mlp,
                                           share.segments)
                _gated_rows(ops, share.x_sC, gate_mlp, block.mlp, h_sC, share.segments,
                            ffn_chunk, ffn_floor)
                del h_sC
            if k:
                with device_current(share.device):
                    self.helper_weights[k].end(index)
        state.version = tensor_version(state.h_SC)

    @staticmethod
    def _attend(ops: H3Ops, attn: torch.nn.Module, buf_S3gD: torch.Tensor, g: int,
                transformer_options: dict) -> torch.Tensor:
        """The attention function ComfyUI would call, on one chunk: returns [S, g*D]."""
        seq_len = buf_S3gD.shape[0]
        q_BgSD, k_BgSD, v_BgSD = (buf_S3gD[:, i].transpose(0, 1).unsqueeze(0) for i in range(3))
        kwargs: dict[str, Any] = {"mask": None, "skip_reshape": True,
                                  "transformer_options": transformer_options}
        preferred = getattr(attn, "comfy_attention", None)
        if preferred is not None:
            kwargs["preferred_attention"] = preferred
        out = ops.optimized_attention(ops.wrap(q_BgSD), ops.wrap(k_BgSD), ops.wrap(v_BgSD), g,
                                      **kwargs)
        out_SG = out.reshape(seq_len, -1)
        # links move contiguous rows only (a view here would make the return a strided gather)
        return out_SG if out_SG.is_contiguous() else out_SG.contiguous()


def _row_chunks(chunked: Any, x_sC: torch.Tensor) -> tuple[tuple[int, int | None], ...]:
    """((ffn_chunk, floor), (qkv_chunk, floor)) from an activation-chunking forward on the
    block for this share (its plan keeps each phase's row floor), else unchunked."""
    if chunked is None:
        return (0, None), (0, None)
    plan = chunked.row_plan(x_sC)
    return (plan.ffn_chunk, plan.ffn_floor), (plan.qkv_chunk, plan.qkv_floor)


def _gated_rows(ops: H3Ops, x_sC: torch.Tensor, gate: torch.Tensor, module: torch.nn.Module,
                input_sK: torch.Tensor, segments: Segments, chunk: int,
                floor: int | None = None) -> None:
    """x += gate * module(input) per segment, `chunk` rows at a time (all at once when 0)."""
    ranges = row_chunks(x_sC.shape[0], chunk, floor)
    if len(ranges) <= 1:
        ops.mod_gate(x_sC, gate, module(input_sK), segments)
        return
    for start, stop in ranges:
        part = module(input_sK[start:stop])
        ops.mod_gate(x_sC[start:stop], gate, part, clip_segments(segments, start, stop))
        del part  # this chunk's output is freed before the next chunk runs
