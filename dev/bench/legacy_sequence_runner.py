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
from typing import Any

import torch

from ..chunking.sizing import row_chunks
from ..exchange.links import Link
from ..exchange.streams import current_stream, record, wait
from ..exchange.transport import TransportMode
from ..sequence import runner as _runner
from ..sequence.runner import SplitState, clip_segments, device_current, tensor_version
from ..sequence.split import SequenceSplit
from ..sequence.weights import HelperWeights
from .legacy_h3_ops import H3Ops, project_rows

Segments = list[tuple[int, int, Any]]


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

    # the scatter and gather are the product runner's own (the same code, not a copy): they use
    # only `devices`, `split` and `link`, which this runner has too
    scatter = _runner.SequenceRunner.scatter
    _send = _runner.SequenceRunner._send
    gather = _runner.SequenceRunner.gather

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
