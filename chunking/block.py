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
the same kernels as the unchunked call: row chunks stay at or above each phase's measured floor
(`exact_rows`: the block's GEMMs with the on-activation adapters found on it at run time, on
this GPU model), head groups above EXACT_MIN_HEADS (`sizing`). A phase with no known floor
(e.g. a rank-32 LoRA on fc2, whose down projection never settles on one kernel) is left whole
while it fits in memory; when memory needs it chunked, it runs chunked and the status line
(`ChunkingReport`, updated at run time) says it may differ, naming the adapter, and a warning
is logged once. Legend: S tokens, C hidden, H heads, D head dim, I = H*D, g heads per call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from ..offload.comfy_memory import free_vram_bytes
from . import exact_rows, sizing
from .config import AUTO, ChunkingConfig
from .h3_ops import H3Ops, block_adapter_ranks, skipped_adapter_note, weight_format

log = logging.getLogger(__name__)
Segments = list[tuple[int, int, Any]]
Ranks = tuple[tuple[str, tuple[int, ...]], ...]  # (linear name, adapter ranks), in LINEARS order
Formats = tuple[tuple[str, str], ...]  # (linear name, weight format), in LINEARS order
_said: set[str] = set()


@dataclass(frozen=True)
class RowPlan:
    """What one block forward runs: chunk sizes (0 = off), the floors `row_chunks` keeps each
    phase's chunks at, why the result may differ from the unchunked block (empty: exact) and
    which phases were left whole to stay exact."""

    ffn_chunk: int
    qkv_chunk: int
    head_group: int
    ffn_floor: int
    qkv_floor: int
    inexact: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    assumed: str = ""  # row chunks ran on a GPU whose floors are not measured (RowFloors)
    notes: tuple[str, ...] = ()  # what the status says besides (an adapter upstream skips)

    @property
    def chunks(self) -> tuple[int, int, int]:
        return self.ffn_chunk, self.qkv_chunk, self.head_group


class ChunkingReport:
    """The status line of one `apply_activation_chunking`, kept true at run time.

    Before any forward it says what the config and the adapters visible at apply time allow.
    The block forwards then record what they ran (adapters that ComfyUI injects only while the
    model is loaded, chunks "auto" chose, phases left whole): the line becomes "exact" or names
    every reason seen, in each status dict it was written to (`sinks`), and each reason is
    logged once per process.
    """

    def __init__(self, config: ChunkingConfig, block_count: int, heads: int | None,
                 floors: sizing.RowFloors):
        self.config = config
        self.block_count = block_count
        self.heads = heads
        self.apply_note = sizing.exactness_note(config.ffn_chunk, config.qkv_chunk,
                                                config.head_group, floors)
        self.inexact: dict[str, None] = {}
        self.kept: dict[str, None] = {f"{phase} kept whole ({floors.why(phase)})": None
                                      for phase in ("ffn", "qkv")
                                      if floors.never(phase) and getattr(config, f"{phase}_chunk")}
        self.assumed = ""
        self.ran = False
        self.sinks: list[dict] = []

    def line(self) -> str:
        if not self.ran:
            return self.config.status(self.block_count, self.heads, note=self.apply_note,
                                      kept=tuple(self.kept))
        note = sizing.note_of(tuple(self.inexact))
        if note == "exact" and self.assumed:
            note = f"exact as assumed ({self.assumed})"
        return self.config.status(self.block_count, self.heads, note=note,
                                  kept=tuple(self.kept))

    def record(self, plan: RowPlan) -> None:
        new = [r for r in plan.inexact if r not in self.inexact]
        kept = [k for k in (*plan.kept, *plan.notes) if k not in self.kept]
        assumed = plan.assumed and not self.assumed
        if self.ran and not new and not kept and not assumed:
            return
        self.ran = True
        self.assumed = self.assumed or plan.assumed
        self.inexact.update(dict.fromkeys(new))
        self.kept.update(dict.fromkeys(kept))
        line = self.line()
        for sink in self.sinks:
            sink["chunking"] = line
        for reason in new:
            if reason not in _said:
                _said.add(reason)
                log.warning("activation chunking may differ from unchunked at bf16 rounding "
                            "(%s)", reason)


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


def project_rows(linear: torch.nn.Module, x_SK: torch.Tensor, chunk: int,
                 floor: int | None = None) -> torch.Tensor:
    """linear(x) as [S, N], computed `chunk` rows at a time into one preallocated buffer.

    Each chunk goes through the module's own call (weight casts, LoRA weight patches, bypass
    adapters), so only one chunk's output and adapter temporaries exist besides the buffer.
    floor: the phase's `RowPlan` floor (None: EXACT_MIN_ROWS), see `sizing.row_chunks`.
    """
    ranges = sizing.row_chunks(x_SK.shape[0], chunk, floor)
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

    def __init__(self, block: torch.nn.Module, config: ChunkingConfig,
                 report: ChunkingReport | None = None):
        self.block = block
        self.config = config
        self.report = report
        self.ops = H3Ops.for_block(block)
        self.last_chunks: tuple[int, int, int] | None = None  # (ffn, qkv, head_group) last run
        self.last_plan: RowPlan | None = None
        self._plans: dict[tuple, RowPlan] = {}
        self._floors: dict[tuple, sizing.RowFloors] = {}

    # ------------------------------------------------------------------ chunk sizes
    def chunks_for(self, x_SC: torch.Tensor) -> tuple[int, int, int]:
        """(ffn_chunk, qkv_chunk, head_group) for this forward (see `row_plan`)."""
        return self.row_plan(x_SC).chunks

    def row_plan(self, x_SC: torch.Tensor) -> RowPlan:
        """What this forward runs: "auto" sized from free memory, every row chunk at or above
        its phase's floor for the adapters on the block now, on this GPU model."""
        ranks = self.adapter_ranks()  # bypass adapters are injected at load: look each time
        formats = self.weight_formats()  # a lowvram LoRA makes an INT8 GEMM a plain one
        floors = self.floors(x_SC.device, x_SC.dtype, ranks, formats)
        fixed = {name: getattr(self.config, name) for name in ("ffn_chunk", "qkv_chunk",
                                                                "head_group")}
        needs_free = AUTO in fixed.values() or any(
            isinstance(fixed[f"{phase}_chunk"], int) and fixed[f"{phase}_chunk"] > 0
            and not floors.known(phase) for phase in ("ffn", "qkv"))
        free = free_device_bytes(x_SC.device) if needs_free else None
        # one plan per 64 MiB of free memory
        key = (x_SC.shape[0], ranks, formats, x_SC.device, x_SC.dtype,
               None if free is None else free >> 26)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = self._plan(x_SC, fixed, floors, ranks, free)
        if self.report is not None:
            self.report.record(plan)
        return plan

    def _plan(self, x_SC: torch.Tensor, fixed: dict, floors: sizing.RowFloors, ranks: Ranks,
              free: int | None) -> RowPlan:
        cfg, tokens = self.config, x_SC.shape[0]
        dims, adapters, kernels = self.dims(x_SC), self.adapters(ranks), self.kernels()
        values = dict(fixed)
        if AUTO in fixed.values():
            if free is None:  # no device memory to protect (CPU): "auto" means off
                values = {k: 0 if v == AUTO else v for k, v in fixed.items()}
            else:
                choice = sizing.choose_chunks(
                    free, tokens, dims, adapters=adapters, kernels=kernels,
                    headroom_bytes=cfg.headroom_bytes, floors=floors,
                    **{k: (None if v == AUTO else v) for k, v in fixed.items()})
                values = {"ffn_chunk": choice.ffn_chunk, "qkv_chunk": choice.qkv_chunk,
                          "head_group": choice.head_group}
        kept = []
        for phase in ("ffn", "qkv"):
            name = f"{phase}_chunk"
            if values[name] and floors.never(phase):  # row slices change its result
                values[name] = 0
                kept.append(f"{phase} kept whole ({floors.why(phase)})")
            chunk = values[name]
            if (not chunk or floors.known(phase) or fixed[name] == AUTO
                    or chunk < sizing.EXACT_MIN_ROWS
                    or len(sizing.row_chunks(tokens, chunk, floors.split_floor(phase))) <= 1):
                continue
            # a chunk meant to be exact in a phase without a known floor: only if memory needs it
            if free is not None and sizing.phase_fits_unchunked(
                    free, tokens, dims, phase, head_group=values["head_group"],
                    adapters=adapters, kernels=kernels, headroom_bytes=cfg.headroom_bytes):
                values[name] = 0
                kept.append(f"{phase} left whole ({floors.why(phase)}; it fits unchunked)")
        heads = self.block.attn.heads
        inexact = [*sizing.row_reasons("ffn", values["ffn_chunk"], floors, tokens=tokens),
                   *sizing.row_reasons("qkv", values["qkv_chunk"], floors, tokens=tokens),
                   *sizing.head_reasons(values["head_group"], heads=heads, tokens=tokens)]
        splits = any(values[f"{p}_chunk"] and len(sizing.row_chunks(
            tokens, values[f"{p}_chunk"], floors.split_floor(p))) > 1 for p in ("ffn", "qkv"))
        note = skipped_adapter_note(self.block, self.block.mlp.fc2)
        return RowPlan(values["ffn_chunk"], values["qkv_chunk"], values["head_group"],
                       floors.split_floor("ffn"), floors.split_floor("qkv"), tuple(inexact),
                       tuple(kept), floors.assumed if splits else "",
                       (note,) if note else ())

    def linears(self) -> dict[str, torch.nn.Module]:
        return block_linears(self.block)

    def adapter_ranks(self) -> Ranks:
        """The on-activation adapters that run (`h3_ops.block_adapter_ranks`)."""
        return tuple(block_adapter_ranks(self.block, self.linears()).items())

    def weight_formats(self) -> Formats:
        return tuple((name, weight_format(module)) for name, module in self.linears().items())

    def floors(self, device: torch.device, dtype: torch.dtype, ranks: Ranks,
               formats: Formats | None = None) -> sizing.RowFloors:
        """Each phase's row floor for these adapters and weight formats on this GPU model and
        compute dtype (`exact_rows`)."""
        formats = self.weight_formats() if formats is None else formats
        key = (device, dtype, ranks, formats)
        floors = self._floors.get(key)
        if floors is None:
            floors = block_floors(self.linears(), device, dtype, dict(ranks), dict(formats))
            self._floors[key] = floors
        return floors

    def dims(self, x_SC: torch.Tensor) -> sizing.BlockDims:
        attn, mlp = self.block.attn, self.block.mlp
        return sizing.BlockDims(hidden=x_SC.shape[-1], heads=attn.heads, head_dim=attn.head_dim,
                                ffn=mlp.fc2.in_features, element_bytes=x_SC.element_size())

    def kernels(self) -> sizing.Kernels:
        return sizing.Kernels(mlp=self.ops.mlp_kernel(self.block.mlp.fc2),
                              attention_output_copy=True)

    def adapters(self, ranks: Ranks | None = None) -> sizing.Adapters:
        found = dict(self.adapter_ranks() if ranks is None else ranks)
        rank = max((r for rs in found.values() for r in rs), default=0)
        return sizing.Adapters(rank=rank, qkv=len(found["qkv_proj"]),
                               out_proj=len(found["out_proj"]), fc1=len(found["fc1"]),
                               fc2=len(found["fc2"]))

    # ------------------------------------------------------------------ forward
    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None,
                 attention=None):
        transformer_options = {} if transformer_options is None else transformer_options
        block, ops = self.block, self.ops
        plan = self.row_plan(x)
        self.last_plan, self.last_chunks = plan, plan.chunks
        ffn_chunk, qkv_chunk, head_group = plan.chunks
        heads = block.attn.heads
        head_group = head_group if 0 < head_group < heads else 0
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)

        h = ops.mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)
        decomposable = ((attention is None or attention is block.attn)
                        and rope_freqs is not None and not ops.in_training())
        if decomposable and (qkv_chunk or head_group):
            qkv = project_rows(block.attn.qkv_proj, h, qkv_chunk, plan.qkv_floor)
            del h  # the normed input is consumed: free it before attention allocates
            out = self._attend(qkv, rope_freqs, transformer_options, head_group)
            del qkv
            self._gated_rows(x, gate_msa, block.attn.out_proj, out, mod_segments, qkv_chunk,
                             plan.qkv_floor)
            del out
        else:
            attention = block.attn if attention is None else attention
            ops.mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs,
                                                transformer_options=transformer_options),
                         mod_segments)
            del h  # drop it before norm2 allocates the MLP phase's h

        h = ops.mod_scale_shift(block.norm2(x), shift_mlp, scale_mlp, mod_segments)
        self._gated_rows(x, gate_mlp, block.mlp, h, mod_segments, ffn_chunk, plan.ffn_floor)
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
                    input_SK: torch.Tensor, segments: Segments, chunk: int,
                    floor: int | None = None) -> None:
        """x += gate * module(input), `chunk` rows at a time, in place, per clipped segment."""
        ranges = sizing.row_chunks(x_SC.shape[0], chunk, floor)
        if len(ranges) <= 1:
            self.ops.mod_gate(x_SC, gate, module(input_SK), segments)
            return
        for start, stop in ranges:
            part = module(input_SK[start:stop])
            self.ops.mod_gate(x_SC[start:stop], gate, part, clip_segments(segments, start, stop))
            del part  # free this chunk's output before the next chunk runs


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new activation on `device` can get; None off-GPU.

    ComfyUI's own count inside ComfyUI (DynamicVRAM's evictable VBAR memory included: the DiT
    weights it keeps resident give way to activations), the driver's free memory outside it;
    capped by a per-process memory fraction when one is set (`offload.comfy_memory`).
    """
    return free_vram_bytes(device)


@cache
def device_name(device: torch.device) -> str:
    """The GPU model as `exact_rows.json` names it ("cpu" for the CPU)."""
    if device.type == "cpu":
        return exact_rows.CPU
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def block_linears(block: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """An H3 block's four big linears by the names `exact_rows` uses."""
    attn, mlp = block.attn, block.mlp
    return {"qkv_proj": attn.qkv_proj, "out_proj": attn.out_proj, "fc1": mlp.fc1,
            "fc2": mlp.fc2}


def block_floors(linears: dict[str, torch.nn.Module], device: torch.device, dtype: torch.dtype,
                 ranks: dict[str, tuple[int, ...]],
                 formats: dict[str, str] | None = None) -> sizing.RowFloors:
    """Row floors of a block's two chunked phases, from its linears' shapes, weight formats
    (default: read off the weights) and the ranks of the adapters that run on them."""
    name = device_name(device)
    dtype_name = str(dtype).removeprefix("torch.")
    table = exact_rows.table_for(name, dtype_name)  # of the compute dtype (plain GEMMs)
    shapes = {key: linear_shape(module) for key, module in linears.items()}
    formats = {key: weight_format(module) for key, module in linears.items()} \
        if formats is None else formats
    gpu = name != exact_rows.CPU
    found = {phase: exact_rows.phase_rule(table, shapes, ranks, names,
                                          where=f"{name} {dtype_name}", gpu=gpu, formats=formats,
                                          nvidia=is_nvidia(device))
             for phase, names in exact_rows.PHASE_LINEARS.items()}
    plain = all(exact_rows.format_rule(formats.get(key, dtype_name))[0] == exact_rows.TABLE
                for key in linears)
    assumed = "" if table is not None or not gpu or not plain else (
        f"{name} {dtype_name} is not in chunking/exact_rows.json: row chunks of >= "
        f"{sizing.EXACT_MIN_ROWS:,} rows are taken as exact, as measured on other GPUs; "
        "bench/sweep_chunk_exactness.py measures this one")
    return sizing.RowFloors.of_rules(found["qkv"], found["ffn"], assumed=assumed)


def is_nvidia(device: torch.device) -> bool:
    """A CUDA device of an NVIDIA GPU (not ROCm's HIP under the same name)."""
    return device.type == "cuda" and torch.version.hip is None


def linear_shape(linear: torch.nn.Module) -> tuple[int, int]:
    """(K, N): in and out features of a Linear (ComfyUI's ops included)."""
    k, n = getattr(linear, "in_features", None), getattr(linear, "out_features", None)
    if isinstance(k, int) and isinstance(n, int):
        return k, n
    out_features, in_features = linear.weight.shape[:2]
    return int(in_features), int(out_features)
