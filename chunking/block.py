"""The chunked DiT block forward, installed as a method-level object patch on `blocks.N.forward`.

It computes exactly what the block's own forward computes, with the same kernels, in an order
that keeps the big intermediates chunk-sized:

    h   = scale_shift(norm1(x))                           [S, C]
    qkv = qkv_proj(h) row chunk by row chunk into one [S, 3I] buffer (LoRA/bypass adapters run
          inside each chunk's call, so their extra output is chunk-sized); h is dropped here
    q/k RMSNorm + RoPE in place; attention over g heads per `optimized_attention` call into one
          [S, I] buffer (any attention override sees each group as a call with g heads; groups
          are balanced and, on short sequences, enlarged: `sizing.head_groups`)
    x  += gate_msa * out_proj(out)  per row chunk, clipped to the modulation segments
    h   = scale_shift(norm2(x))
    x  += gate_mlp * mlp(h)          per row chunk (fc1 -> SwiGLU -> fc2 through the block's own
          MLP forward: ComfyUI's fused `linear_input_act` there, the twin's swiglu here)

Row chunking is exact because each output row of a linear, of SwiGLU and of the gated add
depends on its own input row only; head groups are exact because attention heads are
independent. All rows of h are computed before any chunk updates x. On a GPU "exact" also needs
the same kernels as the unchunked call: see the floors in `sizing` (EXACT_MIN_ROWS,
EXACT_MIN_HEADS) and `sizing.exactness_note`. Legend: S tokens, C hidden,
H heads, D head dim, I = H*D, g heads per attention call.
"""

from __future__ import annotations

from typing import Any

import torch

from . import sizing
from .config import AUTO, ChunkingConfig
from .h3_ops import H3Ops, activation_adapters

Segments = list[tuple[int, int, Any]]


def clip_segments(segments: Segments, start: int, stop: int) -> Segments:
    """Modulation segments of rows [start, stop), re-based to start at 0.

    A segment's row is a modulation row index, or (upstream, masked rows) a per-token index
    tensor over the segment; a tensor is sliced to the clipped rows.
    """
    out: Segments = []
    for a, b, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if lo >= hi:
            continue
        if isinstance(row, torch.Tensor) and row.ndim > 0:
            row = row[lo - a:hi - a]
        out.append((lo - start, hi - start, row))
    return out


def project_rows(linear: torch.nn.Module, x_SK: torch.Tensor, chunk: int) -> torch.Tensor:
    """linear(x) as [S, N], computed `chunk` rows at a time into one preallocated buffer.

    Each chunk goes through the module's own call (weight casts, LoRA weight patches, bypass
    adapters), so only one chunk's output and adapter temporaries exist besides the buffer.
    """
    ranges = sizing.row_chunks(x_SK.shape[0], chunk)
    if len(ranges) <= 1:
        return linear(x_SK)
    out_SN = None
    for start, stop in ranges:
        part = linear(x_SK[start:stop])
        if out_SN is None:
            out_SN = torch.empty((x_SK.shape[0], part.shape[-1]), dtype=part.dtype,
                                 device=part.device)
        out_SN[start:stop].copy_(part)
        del part  # free this chunk before the next one is computed
    return out_SN


class ChunkedBlockForward:
    """Replacement for one `DiTBlock.forward`, same signature, same result."""

    def __init__(self, block: torch.nn.Module, config: ChunkingConfig):
        self.block = block
        self.config = config
        self.ops = H3Ops.for_block(block)
        self.last_chunks: tuple[int, int, int] | None = None  # (ffn, qkv, head_group) last run
        self._auto_cache: dict[tuple, tuple[int, int, int]] = {}

    # ------------------------------------------------------------------ chunk sizes
    def chunks_for(self, x_SC: torch.Tensor) -> tuple[int, int, int]:
        """(ffn_chunk, qkv_chunk, head_group) for this forward; "auto" sized from free memory."""
        cfg = self.config
        fixed = {name: getattr(cfg, name) for name in ("ffn_chunk", "qkv_chunk", "head_group")}
        if AUTO not in fixed.values():
            return fixed["ffn_chunk"], fixed["qkv_chunk"], fixed["head_group"]
        free = free_device_bytes(x_SC.device)
        if free is None:  # no device memory to protect (CPU): "auto" means off
            return tuple(0 if v == AUTO else v for v in fixed.values())  # type: ignore[return-value]
        adapters = self.adapters()  # bypass adapters can be injected after apply: look each time
        key = (x_SC.shape[0], free >> 26, adapters)  # one choice per 64 MiB of free memory
        if key not in self._auto_cache:
            if len(self._auto_cache) >= 64:
                self._auto_cache.clear()
            self._auto_cache[key] = self._choose(x_SC, free, fixed, adapters)
        return self._auto_cache[key]

    def _choose(self, x_SC: torch.Tensor, free: int, fixed: dict,
                adapters: sizing.Adapters) -> tuple[int, int, int]:
        cfg = self.config
        choice = sizing.choose_chunks(
            free, x_SC.shape[0], self.dims(x_SC), adapters=adapters,
            kernels=sizing.Kernels(mlp=self.ops.mlp_kernel(self.block.mlp.fc2),
                                   attention_output_copy=True),
            headroom_bytes=cfg.headroom_bytes,
            **{k: (None if v == AUTO else v) for k, v in fixed.items()})
        return choice.ffn_chunk, choice.qkv_chunk, choice.head_group

    def dims(self, x_SC: torch.Tensor) -> sizing.BlockDims:
        attn, mlp = self.block.attn, self.block.mlp
        return sizing.BlockDims(hidden=x_SC.shape[-1], heads=attn.heads, head_dim=attn.head_dim,
                                ffn=mlp.fc2.in_features, element_bytes=x_SC.element_size())

    def adapters(self) -> sizing.Adapters:
        attn, mlp = self.block.attn, self.block.mlp
        found = {name: activation_adapters(module) for name, module in (
            ("qkv", attn.qkv_proj), ("out_proj", attn.out_proj), ("fc1", mlp.fc1),
            ("fc2", mlp.fc2))}
        return sizing.Adapters(rank=max(r for _, r in found.values()),
                               **{name: n for name, (n, _) in found.items()})

    # ------------------------------------------------------------------ forward
    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None,
                 attention=None):
        transformer_options = {} if transformer_options is None else transformer_options
        block, ops = self.block, self.ops
        ffn_chunk, qkv_chunk, head_group = self.chunks_for(x)
        self.last_chunks = (ffn_chunk, qkv_chunk, head_group)
        heads = block.attn.heads
        head_group = head_group if 0 < head_group < heads else 0
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)

        h = ops.mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)
        decomposable = ((attention is None or attention is block.attn)
                        and rope_freqs is not None and not ops.in_training())
        if decomposable and (qkv_chunk or head_group):
            qkv = project_rows(block.attn.qkv_proj, h, qkv_chunk)
            del h  # the normed input is consumed: free it before attention allocates
            out = self._attend(qkv, rope_freqs, transformer_options, head_group)
            del qkv
            self._gated_rows(x, gate_msa, block.attn.out_proj, out, mod_segments, qkv_chunk)
            del out
        else:
            attention = block.attn if attention is None else attention
            ops.mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs,
                                                transformer_options=transformer_options),
                         mod_segments)
            del h  # drop it before norm2 allocates the MLP phase's h

        h = ops.mod_scale_shift(block.norm2(x), shift_mlp, scale_mlp, mod_segments)
        self._gated_rows(x, gate_mlp, block.mlp, h, mod_segments, ffn_chunk)
        return x

    def _attend(self, qkv_SN: torch.Tensor, rope_freqs: torch.Tensor, transformer_options: dict,
                head_group: int) -> torch.Tensor:
        """The block attention's core on a ready qkv buffer: returns [S, I]."""
        attn, ops = self.block.attn, self.ops
        s, heads, dim = qkv_SN.shape[0], attn.heads, attn.head_dim
        inner = heads * dim
        q, k, v = qkv_SN.split(inner, dim=-1)
        q = q.view(1, s, heads, dim)
        k = k.view(1, s, heads, dim)
        ops.rms_rope_(q, k, rope_freqs, ops.norm_weight(attn.q_norm.weight, qkv_SN.device),
                      ops.norm_weight(attn.k_norm.weight, qkv_SN.device), attn.q_norm.eps,
                      rope_freqs.shape[-3] * 2)
        # strided [1, H, S, D] views of the qkv buffer, as the block's own forward hands over
        q_BHSD = q[0].transpose(0, 1).unsqueeze(0)
        k_BHSD = k[0].transpose(0, 1).unsqueeze(0)
        v_BHSD = v.view(s, heads, dim).transpose(0, 1).unsqueeze(0)
        groups = sizing.head_groups(heads, head_group, s)
        if len(groups) <= 1:
            return self._call_attention(q_BHSD, k_BHSD, v_BHSD, heads, transformer_options)[0]
        out_SI = torch.empty((s, inner), dtype=qkv_SN.dtype, device=qkv_SN.device)
        for h0, h1 in groups:
            part = self._call_attention(q_BHSD[:, h0:h1], k_BHSD[:, h0:h1], v_BHSD[:, h0:h1],
                                        h1 - h0, transformer_options)
            out_SI[:, h0 * dim:h1 * dim].copy_(part[0])
            del part  # one group's output at a time
        return out_SI

    def _call_attention(self, q, k, v, heads: int, transformer_options: dict) -> torch.Tensor:
        attn, ops = self.block.attn, self.ops
        kwargs: dict[str, Any] = {"mask": None, "skip_reshape": True,
                                  "transformer_options": transformer_options}
        preferred = getattr(attn, "comfy_attention", None)
        if preferred is not None:
            kwargs["preferred_attention"] = preferred
        return ops.optimized_attention(ops.wrap(q), ops.wrap(k), ops.wrap(v), heads, **kwargs)

    def _gated_rows(self, x_SC: torch.Tensor, gate, module: torch.nn.Module,
                    input_SK: torch.Tensor, segments: Segments, chunk: int) -> None:
        """x += gate * module(input), `chunk` rows at a time, in place, per clipped segment."""
        ranges = sizing.row_chunks(x_SC.shape[0], chunk)
        if len(ranges) <= 1:
            self.ops.mod_gate(x_SC, gate, module(input_SK), segments)
            return
        for start, stop in ranges:
            part = module(input_SK[start:stop])
            self.ops.mod_gate(x_SC[start:stop], gate, part, clip_segments(segments, start, stop))
            del part  # free this chunk's output before the next chunk runs


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes the caching allocator can surely still hand out on `device`; None off-GPU.

    Free device memory, capped by a per-process memory fraction when one is set. The
    allocator's reserved-but-unused blocks are not counted: they are often fragments too small
    for a multi-GiB activation (seen on an H200 capped at 32 GiB: 3.75 GiB reserved but unused,
    and a 4.1 GiB request failed).
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    available = free
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        cap = int(total * get_fraction(device))
        available = min(available, cap - reserved)
    return max(available, 0)
