"""Chunking by wrapping upstream's own modules: the H3 block itself runs unchanged.

Upstream's `DiTBlock.forward` (ComfyUI 0.33.0 and the newest files) is the truth; chunking
changes only on which rows its modules run, never what they compute:

    attn.qkv_proj.forward(h)   row chunk by row chunk into one [S, 3I] buffer (the LoRA/bypass
                               adapters run inside each chunk's call: their extra output is
                               chunk-sized)
    attention                  g heads per call of the function ComfyUI would run (an attention
                               override, `HeadGroups`, chained with any other override)
    attn.out_proj.forward(o)   row chunks into one [S, C] buffer
    mlp.forward(h)             row chunks written back into h's rows (upstream drops h after
                               the call): each chunk runs upstream's whole MLP (fc1 -> SwiGLU
                               -> fc2, ComfyUI's fused `linear_input_act` there), so the fc1
                               output is chunk-sized

The module wrappers are installed at call time, by a DIFFUSION_MODEL wrapper, around whatever
forward the module has at that moment (ComfyUI injects its bypass adapters while it loads the
model, after any object patch would have been applied), so they are outermost and every
adapter, weight cast and LowVramPatch runs per chunk; they are removed when the forward returns.

Row chunking is exact because each output row of these modules depends on its own input row
only (each chunk's rows keep their order: `project_rows` writes chunk [a, b) to rows [a, b));
head groups are exact because attention heads are independent. On a GPU "exact" also needs the
same kernels as the unchunked call: row chunks stay at or above each phase's measured floor for
the weight format and the adapters found at run time (`exact_rows`), head groups at or above
EXACT_MIN_HEADS (`sizing`). A phase with no known floor is left whole while it fits in memory;
when memory needs it chunked it runs chunked and the status line says it may differ.
Legend: S tokens, C hidden, H heads, D head dim, I = H*D, g heads per call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..comfy_seam import h3 as seam_h3
from ..comfy_seam import names
from ..comfy_seam.memory import free_vram_bytes
from ..comfy_seam.protocol import override_of
from ..common import floors as common_floors
from ..common.formats import block_adapter_ranks, block_floors, block_linears, skipped_adapter_note
from . import sizing
from .config import AUTO, ChunkingConfig
from .report import ChunkingReport, RowPlan

log = logging.getLogger(__name__)
Ranks = tuple[tuple[str, tuple[int, ...]], ...]  # (linear name, adapter ranks), LINEARS order
Formats = tuple[tuple[str, str], ...]  # (linear name, weight format), LINEARS order
WRAPPED = ("attn.qkv_proj", "attn.out_proj", "mlp")  # the modules whose forward is row-chunked


def project_rows(forward: Callable[[torch.Tensor], torch.Tensor], x_SK: torch.Tensor,
                 ranges: list[tuple[int, int]], into_input: bool = False) -> torch.Tensor:
    """forward(x) as [S, N], computed range by range into one buffer (rows of chunk [a, b)
    land in rows [a, b)): only one chunk's output and temporaries exist besides.

    into_input: the buffer is x itself when the output has x's shape and dtype (chunk [a, b)
    is written after its own rows were read, and no later chunk reads them): for the MLP,
    whose input upstream's block drops right after the call."""
    if len(ranges) <= 1:
        return forward(x_SK)
    out_SN = None
    for start, stop in ranges:
        part = forward(x_SK[start:stop])
        if out_SN is None:
            reuse = (into_input and x_SK.is_contiguous() and part.dtype == x_SK.dtype
                     and part.shape[1:] == x_SK.shape[1:] and not x_SK.requires_grad)
            out_SN = x_SK if reuse else torch.empty(
                (x_SK.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        out_SN[start:stop].copy_(part)
        del part  # free this chunk before the next one is computed
    return out_SN


class RowChunkedForward:
    """The forward a wrapped module has while a chunked DiT forward runs.

    `original_forward` is the forward the module had when the wrapper went on (a bypass hook's,
    or the class's). Each call adds its chunk count to the chunker's `calls[name]`."""

    def __init__(self, chunker: BlockChunker, name: str, original_forward: Callable):
        self.chunker = chunker
        self.name = name
        self.original_forward = original_forward

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or x.dim() != 2:  # not the block's call: run it as it was
            return self.original_forward(x, *args, **kwargs)
        ranges = self.chunker.ranges(self.name, x)
        self.chunker.calls[self.name] += len(ranges)
        # the MLP's input is upstream's modulated norm2 output, dropped after this call
        return project_rows(self.original_forward, x, ranges, into_input=self.name == "mlp")


class BlockChunker:
    """One DiT block's chunking: its row plan per forward and its module wrappers."""

    def __init__(self, block: torch.nn.Module, config: ChunkingConfig,
                 report: ChunkingReport | None, runtime: ChunkingRuntime):
        self.block = block
        self.config = config
        self.report = report
        self.runtime = runtime
        self.last_plan: RowPlan | None = None
        self.current: RowPlan | None = None  # the plan of the block call running now
        self.calls = dict.fromkeys(WRAPPED, 0)  # chunk calls made per wrapped module
        self._plans: dict[tuple, RowPlan] = {}
        self._floors: dict[tuple, sizing.RowFloors] = {}

    @property
    def last_chunks(self) -> tuple[int, int, int] | None:
        return None if self.last_plan is None else self.last_plan.chunks

    # ------------------------------------------------------------------ installing
    def modules(self) -> dict[str, torch.nn.Module]:
        return {name: self.block.get_submodule(name) for name in WRAPPED}

    @contextlib.contextmanager
    def wrapped(self) -> Iterator[None]:
        """The block's modules run row-chunked inside the `with`; restored after."""
        saved = []
        try:
            for name, module in self.modules().items():
                own = module.__dict__.get("forward", _MISSING)
                saved.append((module, own))
                module.forward = RowChunkedForward(self, name, module.forward)
            self.current = None
            yield
        finally:
            for module, own in reversed(saved):
                if own is _MISSING:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = own
            self.current = None

    # ------------------------------------------------------------------ per call
    def ranges(self, name: str, x_SK: torch.Tensor) -> list[tuple[int, int]]:
        """The row ranges the module `name` runs on for this input (one range: whole)."""
        if name == "attn.qkv_proj" or self.current is None or \
                self.current.tokens != x_SK.shape[0]:
            self.current = self.row_plan(x_SK)
        plan = self.current
        if name == "attn.qkv_proj":
            self.runtime.armed = self if plan.head_group else None
        elif name == "attn.out_proj":
            self.runtime.armed = None
        if name == "mlp":
            return sizing.row_chunks(x_SK.shape[0], plan.ffn_chunk, plan.ffn_floor)
        return sizing.row_chunks(x_SK.shape[0], plan.qkv_chunk, plan.qkv_floor)

    def head_ranges(self, heads: int, tokens: int) -> list[tuple[int, int]]:
        plan = self.current
        if plan is None or not plan.head_group or heads != self.block.attn.heads:
            return [(0, heads)]
        return sizing.head_groups(heads, plan.head_group, tokens)

    # ------------------------------------------------------------------ planning
    def row_plan(self, x_SC: torch.Tensor) -> RowPlan:
        """What this block call runs: "auto" sized from free memory, every row chunk at or
        above its phase's floor for the adapters on the block now, on this GPU model."""
        ranks = self.adapter_ranks()  # bypass adapters are injected at load: look each time
        formats = self.weight_formats()  # a lowvram LoRA makes an INT8 GEMM a plain one
        floors = self.floors(x_SC.device, x_SC.dtype, ranks, formats)
        fixed = {name: getattr(self.config, name) for name in ("ffn_chunk", "qkv_chunk",
                                                                "head_group")}
        needs_free = AUTO in fixed.values() or any(
            fixed[f"{p}_chunk"] and not floors.known(p) for p in ("ffn", "qkv"))
        free = self.runtime.free_bytes(x_SC.device) if needs_free else None
        # one plan per 64 MiB of free memory
        key = (x_SC.shape[0], ranks, formats, x_SC.device, x_SC.dtype,
               None if free is None else free >> 26)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = self._plan(x_SC, fixed, floors, ranks, free)
        self.last_plan = plan
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
                    or chunk < common_floors.EXACT_MIN_ROWS
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
        note = skipped_adapter_note(self.block)
        return RowPlan(values["ffn_chunk"], values["qkv_chunk"], values["head_group"],
                       floors.split_floor("ffn"), floors.split_floor("qkv"), tuple(inexact),
                       tuple(kept), floors.assumed if splits else "",
                       (note,) if note else (), tokens)

    def linears(self) -> dict[str, torch.nn.Module]:
        return block_linears(self.block)

    def adapter_ranks(self) -> Ranks:
        """The on-activation adapters that run (`formats.block_adapter_ranks`)."""
        return tuple(block_adapter_ranks(self.block).items())

    def weight_formats(self) -> Formats:
        return tuple((name, seam_h3.weight_format(module))
                     for name, module in self.linears().items())

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
        return sizing.Kernels.of(self.block)  # the planner reads the same seam answer

    def adapters(self, ranks: Ranks | None = None) -> sizing.Adapters:
        found = dict(self.adapter_ranks() if ranks is None else ranks)
        rank = max((r for rs in found.values() for r in rs), default=0)
        return sizing.Adapters(rank=rank, qkv=len(found["qkv_proj"]),
                               out_proj=len(found["out_proj"]), fc1=len(found["fc1"]),
                               fc2=len(found["fc2"]))


_MISSING = object()


class ChunkingRuntime:
    """The chunkers of one `apply_activation_chunking` and what their wrappers share."""

    def __init__(self) -> None:
        self.chunkers: dict[int, BlockChunker] = {}
        self.armed: BlockChunker | None = None  # the block whose attention call comes next
        self.depth = 0

    def free_bytes(self, device: torch.device) -> int | None:
        return free_device_bytes(device)

    def __deepcopy__(self, memo) -> ChunkingRuntime:
        return self  # holds the model's own modules: never copied with model_options

    @contextlib.contextmanager
    def wrapped(self) -> Iterator[None]:
        """Every chunked block's modules wrapped for one DiT forward (re-entry: as they are)."""
        if self.depth:
            yield
            return
        self.depth += 1
        try:
            with contextlib.ExitStack() as stack:
                for chunker in self.chunkers.values():
                    stack.enter_context(chunker.wrapped())
                yield
        finally:
            self.depth -= 1
            self.armed = None

    def diffusion_model_wrapper(self) -> Callable:
        def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
            with self.wrapped():
                return executor(*args, **kwargs)

        wrapper.h3_multigpu_chunking = self  # type: ignore[attr-defined]
        return wrapper


class HeadGroups:
    """Attention override: the call that follows a chunked block's qkv projection runs g heads
    per call of the function ComfyUI would run (or of the override installed before, which
    then sees each group as a call with g heads). Any other call passes through unchanged."""

    def __init__(self, runtime: ChunkingRuntime, previous: Any = None):
        self.runtime = runtime
        self.previous = previous

    def __deepcopy__(self, memo) -> HeadGroups:
        return self

    def __call__(self, func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any,
                 **kwargs: Any) -> Any:
        chunker = self.runtime.armed
        groups = [(0, heads)]
        if (chunker is not None and not args and kwargs.get("mask") is None
                and kwargs.get("skip_reshape") and not kwargs.get("skip_output_reshape")
                and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] == heads):
            groups = chunker.head_ranges(heads, q.shape[2])
        function = self._function(func, chunker, kwargs)
        if len(groups) <= 1:
            return self._call(function, q, k, v, heads, args, kwargs)
        b, _, s, d = q.shape
        out_BSI = torch.empty((b, s, heads * d), dtype=q.dtype, device=q.device)
        for h0, h1 in groups:
            part = self._call(function, q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], h1 - h0, args,
                              kwargs)
            out_BSI[..., h0 * d:h1 * d].copy_(part)
            del part  # one group's output at a time
        return out_BSI

    def _function(self, func: Any, chunker: BlockChunker | None, kwargs: dict) -> Any:
        """What ComfyUI would run for this call without us: called by ComfyUI itself with no
        override before us, the running module's preferred attention where it has one
        (`wrap_attn` pops `preferred_attention` before it calls an override), else `func`."""
        options = kwargs.get(names.TRANSFORMER_OPTIONS)
        outermost = isinstance(options, dict) and seam_override(options) is self
        if outermost and self.previous is None and chunker is not None:
            preferred = seam_h3.preferred_function(chunker.block.attn)
            if preferred is not None:
                return preferred
        return func

    def _call(self, function: Any, q, k, v, heads: int, args: tuple, kwargs: dict) -> Any:
        if self.previous is not None:
            return self.previous(function, q, k, v, heads, *args, **kwargs)
        return function(q, k, v, heads, *args, **kwargs)


def seam_override(options: dict) -> Any:
    return override_of(options)


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new activation on `device` can get; None off-GPU: ComfyUI's own count inside
    ComfyUI (DynamicVRAM's evictable VBAR memory included), the driver's outside it."""
    return free_vram_bytes(device)
