"""The split plan: which block-replace arguments split along which rows, where the output gathers.

Declared once, as data, in the manner of Diffusers' context-parallel plan (`_cp_plan`: per
argument a split spec, dim and expected dims, and a gather spec for the output). An H3
block-replace patch is called as `patch(args, extra)` and returns `{img: new h}`; the keys are
ComfyUI's (`comfy_seam.names`, checked per release in `comfy_seam.internals`). Per share of
token rows [start, stop):

- `img` (the residual stream h [S, C]): split along dim 0; its share stays on its device for
  the whole block loop; the output `img` is gathered back along dim 0 into the model's h.
- `rope_freqs` (the RoPE table [1, S, 1, r/2, 2, 2], one row per token): split along dim 1.
- `mod_segments` ((start, stop, modulation row) ranges over the token rows, a row being an
  index or a per-token index tensor): clipped to the share's rows and re-based to 0.
- `t_emb` (the timestep embedding, per modulation row, not per token): every share gets all of
  it (the root its own, a helper a copy on its device).
- `transformer_options`: every share gets the forward's, with its own attention override.

A block call that carries anything in `NOT_SPLIT` (newest files: an attention module handed to
the block) is not split: the mode then runs it whole. `runner.py` slices and sends by these
specs; `patches.py` reads the arguments and builds each share's call by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam import names

Segments = list[tuple[int, int, Any]]


@dataclass(frozen=True)
class RowSplit:
    """Split along the token rows: dim `dim` of a tensor of `expected_dims` dims."""

    dim: int
    expected_dims: int

    def rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The share's rows, a view."""
        if tensor.ndim != self.expected_dims:
            raise ValueError(f"the split plan expects {self.expected_dims} dims (rows along dim "
                             f"{self.dim}), got a tensor of shape {tuple(tensor.shape)}")
        return tensor.narrow(self.dim, start, stop - start)

    def shape(self, tensor: torch.Tensor, rows: int) -> tuple[int, ...]:
        """The shape of a share of `rows` rows (a helper's own buffer)."""
        shape = list(tensor.shape)
        shape[self.dim] = rows
        return tuple(shape)


@dataclass(frozen=True)
class RowTable:
    """A table of (start, stop, row) ranges over the token rows, clipped like the rows."""

    def rows(self, segments: Segments, start: int, stop: int) -> Segments:
        """The ranges of rows [start, stop), re-based to start at 0; a per-token index tensor
        is sliced to the clipped rows."""
        out: Segments = []
        for a, b, row in segments:
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                continue
            if isinstance(row, torch.Tensor) and row.ndim > 0:
                row = row[lo - a:hi - a]
            out.append((lo - start, hi - start, row))
        return out


@dataclass(frozen=True)
class Replicate:
    """Every share gets the whole value."""


@dataclass(frozen=True)
class Gather:
    """The output: each share's rows written back along dim `dim` of the model's tensor."""

    dim: int


Spec = RowSplit | RowTable | Replicate

# the residual stream: split by its own rows, continued block to block (`runner.SplitState`)
RESIDUAL = names.BLOCK_IMG
SPLIT_PLAN: dict[str, Spec] = {
    names.BLOCK_IMG: RowSplit(dim=0, expected_dims=2),
    names.BLOCK_T_EMB: Replicate(),
    names.BLOCK_SEGMENTS: RowTable(),
    names.BLOCK_ROPE: RowSplit(dim=1, expected_dims=6),
}
GATHER_PLAN: dict[str, Gather] = {names.BLOCK_IMG: Gather(dim=0)}
# the per-forward inputs a split state was built for (they change only with the forward)
INPUTS = tuple(key for key in SPLIT_PLAN if key != RESIDUAL)
# upstream `DiTBlock.forward(x, t_emb, mod_segments, rope_freqs, transformer_options=...)`:
# the order a helper calls its block in (checked per release in `comfy_seam.internals`)
BLOCK_ARGS = (names.BLOCK_IMG, names.BLOCK_T_EMB, names.BLOCK_SEGMENTS, names.BLOCK_ROPE)
OPTIONS = names.TRANSFORMER_OPTIONS  # every share: the forward's, with its own override
OUTPUT = names.BLOCK_IMG
NEEDED = (names.BLOCK_ROPE,)  # a block call without these is not the one the plan splits
NOT_SPLIT = (names.BLOCK_ATTENTION,)  # a block call carrying these runs whole


def root_share(spec: Any, value: Any, start: int, stop: int) -> Any:
    """The root's share of one argument: views of the model's tensors."""
    if isinstance(spec, RowSplit):
        return spec.rows(value, start, stop)
    if isinstance(spec, RowTable):
        return spec.rows(value, start, stop)
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def helper_share(spec: Any, value: Any, start: int, stop: int, device: torch.device
                  ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A helper's share of one argument, as buffers on its device, and the (destination,
    contiguous source) copies that fill them."""
    if isinstance(spec, RowSplit):
        buf = torch.empty(spec.shape(value, stop - start), dtype=value.dtype, device=device)
        return buf, [(buf, spec.rows(value, start, stop).contiguous())]
    if isinstance(spec, RowTable):
        table, copies = [], []
        for s0, s1, row in spec.rows(value, start, stop):
            if isinstance(row, torch.Tensor):
                row_k = torch.empty(row.shape, dtype=row.dtype, device=device)
                copies.append((row_k, row.contiguous()))
                row = row_k
            table.append((s0, s1, row))
        return table, copies
    if isinstance(value, torch.Tensor):
        src = value.contiguous()
        buf = torch.empty_like(src, device=device)
        return buf, [(buf, src)]
    return value, []


def splittable(args: dict) -> bool:
    """The block call the plan splits: the block's own attention, RoPE present."""
    return all(args.get(key) is None for key in NOT_SPLIT) and \
        all(args.get(key) is not None for key in NEEDED)


def inputs_of(args: dict) -> tuple[Any, ...]:
    """The per-forward inputs of a block call, in `INPUTS` order."""
    return tuple(args[key] for key in INPUTS)


def positional(args: dict) -> tuple[Any, ...]:
    """A share's arguments in upstream's block order (`BLOCK_ARGS`)."""
    return tuple(args[key] for key in BLOCK_ARGS)


def block_args(*values: Any) -> dict[str, Any]:
    """Block arguments keyed by the plan from values in upstream's block order (`BLOCK_ARGS`)."""
    return dict(zip(BLOCK_ARGS, values, strict=True))


def clip_segments(segments: Segments, start: int, stop: int) -> Segments:
    """`mod_segments` of rows [start, stop), re-based to 0 (the plan's row table)."""
    spec = SPLIT_PLAN[names.BLOCK_SEGMENTS]
    assert isinstance(spec, RowTable)
    return spec.rows(segments, start, stop)
