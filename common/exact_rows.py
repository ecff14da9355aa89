"""Where a row slice of a GEMM gives the whole call's bits: measured floors per GPU and shape.

Activation chunking (and the sequence-parallel mode's row shares) runs each big linear on a
slice of the token rows. On a GPU the slice equals the same rows of one whole call only while
cuBLAS keeps the same kernel (tile shape, split-K, reduction order), and cuBLAS chooses by the
row count M, the reduction K and the output width N. `exact_rows.json` holds, per GPU model and
dtype, per GEMM shape "K->N", the fewest rows from which every measured slice was bit-identical
to the whole call (slices of 256..32,768 rows against whole calls of 3,320..102,363 rows;
null: no measured slice size was). `dev/bench/sweep_chunk_exactness.py --write-range
chunking/exact_rows.json` measures and writes it (`--from` rewrites it from a sweep's JSON).

The rule, in one place (chunking, the planner's predictions and `sequence/` all use it):
- A linear's row floor is the largest floor of the GEMMs one call runs: its own K->N and, for
  each on-activation (bypass) adapter of rank r on it, the adapter's down projection K->r and
  up projection r->N. A chunked phase takes the largest floor of its linears (qkv_proj with
  out_proj; fc1 with fc2); the sequence mode's row shares take all four.
- The linear's own GEMM is never trusted below `sizing.EXACT_MIN_ROWS` (4,096 rows: what the
  whole-model GPU tests prove end to end, bias and ComfyUI's casts included); the table raises
  that where it measured more. A base shape the table does not list (another GPU, another
  model width) keeps 4,096: the measured base floors are 256-512 rows, an 8x margin.
- An adapter's GEMMs (N or K = the rank: a handful of output tiles, where cuBLAS turns to
  split-K kernels whose choice moves with M; on H200 exact only from 2,300-8,192 rows, and the
  rank-32 down projection of fc2 never) count as exact only with a measured floor for this GPU
  model, dtype and shape. Another rank, GPU or dtype has no floor: not claimed exact.
- The CPU is a stand-in (tests): it keeps the 4,096-row rule for adapters too, unless a table
  lists it (tests install one). Measured there (x86-64, torch 2.13, 1/2/4 threads, the tiny
  shapes): bf16 row slices always bit-identical, fp32 ones with 2 threads only from 12 rows.
A phase without a floor is not chunked unless memory requires it, and then the status says it
may differ (`chunking.wrappers`); a sequence share without one makes the mode fall back.

All of the above is for plain weights. The floors are per weight format
(`comfy_seam.h3.weight_format` reads it off each linear's weight; `FORMAT_RULES` here):
- INT8 ConvRot (`TensorWiseINT8Layout` with convrot) quantizes activations per row and
  accumulates in int32: on NVIDIA GPUs (comfy-kitchen's CUDA `int8_linear`) any row slice is
  bit-identical (the fused SwiGLU fc2 from 2 rows, measured on an H200), so neither the table
  nor the 4,096-row rule applies to its GEMM there (base 1 row, fc2 2); an on-activation
  adapter's own GEMMs are plain ones and keep the plain rules. On the CPU
  (comfy-kitchen's eager kernel) it keeps the CPU rule: measured bit-identical at 1-4,096 rows
  with bf16 activations, but with fp32 ones (what ComfyUI computes on a CPU) slices of 1-3 rows
  differ single-threaded and of up to 11 rows with 2 threads. Other GPUs (ROCm): not measured.
- FP8 (static input scale, fp32-accumulating `_scaled_mm`) and INT8 without ConvRot: nothing
  measured, so no floor is known (kept whole while it fits, as an unmeasured adapter is).
- NVFP4 without `input_scale` scales the activations over the whole tensor: a row slice changes
  the result, so such a linear is never row-split (`never`), whatever memory says.

Torch-free: the planner imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

TABLE_FILE = Path(__file__).with_name("exact_rows.json")
CPU = "cpu"
PLAIN_FORMATS = ("bfloat16", "float16", "float32")
INT8_CONVROT = "int8_convrot"
ANY, TABLE, UNKNOWN, NEVER = "any", "table", "unknown", "never"
# weight format -> (what row slices of its GEMM do, why)
FORMAT_RULES: dict[str, tuple[str, str]] = {
    INT8_CONVROT: (ANY, "INT8 ConvRot quantizes activations per row and accumulates in int32: "
                        "row slices are bit-identical at any row count on NVIDIA GPUs, the fused "
                        "SwiGLU fc2 from 2 rows (measured: comfy-kitchen 0.2.31's CUDA "
                        "int8_linear on H200, 1-8,192-row slices of 3,320- and 16,640-row calls; "
                        "a 1-row fc2+swiglu slice differs)"),
    "int8": (UNKNOWN, "INT8 weights without ConvRot: no row floor measured"),
    "fp8": (UNKNOWN, "FP8 weights (static input scale, fp32-accumulating _scaled_mm): no row "
                     "floor measured"),
    "nvfp4": (UNKNOWN, "NVFP4 weights with a static input_scale: no row floor measured"),
    "nvfp4_dynamic": (NEVER, "NVFP4 weights without input_scale scale the activations over the "
                             "whole tensor: a row slice changes the scale and the result"),
}
# INT8 ConvRot's fused SwiGLU fc2 (ComfyUI's linear_input_act): a 1-row slice differed on an
# H200 (docs/results/int8_chunk_exactness.json); 2 rows and more were bit-identical
INT8_FUSED_FC2_MIN_ROWS = 2
# H3's chunked phases and the linears each runs with its row chunk
PHASE_LINEARS = {"qkv": ("qkv_proj", "out_proj"), "ffn": ("fc1", "fc2")}
LINEARS = ("qkv_proj", "out_proj", "fc1", "fc2")


def shape_key(k: int, n: int) -> str:
    return f"{k}->{n}"


@dataclass(frozen=True)
class GemmTable:
    """Measured floors of one GPU model and dtype: "K->N" -> fewest exact rows (None: never)."""

    device: str
    dtype: str
    floors: Mapping[str, int | None] = field(default_factory=dict)
    source: str = ""

    def lookup(self, k: int, n: int) -> tuple[bool, int | None]:
        """(listed, floor): whether K->N was measured, and its floor (None: never exact)."""
        key = shape_key(k, n)
        return key in self.floors, self.floors.get(key)


def parse_tables(data: dict) -> tuple[GemmTable, ...]:
    tables = []
    for device, per_dtype in data.get("devices", {}).items():
        for dtype, entry in per_dtype.items():
            tables.append(GemmTable(device, dtype, dict(entry.get("floors", {})),
                                    entry.get("source", "")))
    return tuple(tables)


@cache
def load_tables(path: str = str(TABLE_FILE)) -> tuple[GemmTable, ...]:
    file = Path(path)
    if not file.exists():
        return ()
    return parse_tables(json.loads(file.read_text()))


def table_for(device_name: str, dtype: str) -> GemmTable | None:
    """The measured table of this GPU model (`torch.cuda.get_device_name`) and dtype
    ("bfloat16"), or None. Tests replace this function to install a table."""
    for table in load_tables():
        if table.device == device_name and table.dtype == dtype:
            return table
    return None


@cache
def planning_table(dtype: str = "bfloat16") -> GemmTable | None:
    """Every measured GPU's floors of `dtype` merged (largest; None wins): what the torch-free
    planner predicts chunk sizes with, before it knows the GPU's kernels."""
    tables = [t for t in load_tables() if t.dtype == dtype]
    if not tables:
        return None
    merged: dict[str, int | None] = {}
    for table in tables:
        for key, value in table.floors.items():
            if key not in merged:
                merged[key] = value
            elif merged[key] is not None:
                merged[key] = None if value is None else max(merged[key], value)
    return GemmTable("planning", dtype, merged, "merged: " + ", ".join(t.device for t in tables))


def linear_shapes(hidden: int, inner: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(K, N) of H3's four block linears."""
    return {"qkv_proj": (hidden, 3 * inner), "out_proj": (inner, hidden),
            "fc1": (hidden, 2 * ffn), "fc2": (ffn, hidden)}


def format_rule(weight_format: str) -> tuple[str, str]:
    """(ANY | TABLE | UNKNOWN | NEVER, why) for a linear whose weight is in `weight_format`."""
    if weight_format in PLAIN_FORMATS:
        return TABLE, ""
    return FORMAT_RULES.get(weight_format,
                            (UNKNOWN, f"{weight_format} weights: no row floor measured"))


@dataclass(frozen=True)
class PhaseRule:
    """Rows per call from which a linear (or a phase of them) is known exact in row slices.

    floor: beyond `base` (0: nothing more); None: no known floor (`why` names the GEMM).
    base: the linears' own minimum: None the generic rule (`sizing.EXACT_MIN_ROWS`, the
    sequence mode's share floor), 1 any row count (INT8 ConvRot). never: row slices change the
    result (NVFP4 without input_scale): keep it whole.
    """

    floor: int | None = 0
    why: str = ""
    base: int | None = None
    never: bool = False

    @classmethod
    def combine(cls, rules: list[PhaseRule]) -> PhaseRule:
        """The largest floor and base; the first rule without a floor decides (never first)."""
        for rule in rules:
            if rule.never:
                return rule
        for rule in rules:
            if rule.floor is None:
                return rule
        bases = [r.base for r in rules]
        base = None if not bases or None in bases else max(b for b in bases if b is not None)
        return cls(max((r.floor or 0 for r in rules), default=0), "", base)


def linear_rule(table: GemmTable | None, name: str, k: int, n: int, ranks: tuple[int, ...],
                *, where: str, gpu: bool = True, weight_format: str = "bfloat16",
                nvidia: bool = True) -> PhaseRule:
    """What row slices of `name` (K->N, weight in `weight_format`, with on-activation adapters
    of `ranks`, whose GEMMs run in the compute dtype `table` is of) need to stay exact.
    nvidia: a GPU is an NVIDIA one (where INT8 ConvRot's any-rows rule was measured)."""
    kind, why = format_rule(weight_format)
    if kind == ANY and not gpu:
        kind = TABLE  # the CPU's eager INT8 kernel keeps the CPU rule (see above)
    elif kind == ANY and not nvidia:
        kind, why = UNKNOWN, f"{weight_format} row slices are measured on NVIDIA GPUs only"
    if kind in (NEVER, UNKNOWN):
        return PhaseRule(None, f"{name}: {why}", never=kind == NEVER)
    floor, reason = linear_floor(table, name, k, n, ranks, where=where, gpu=gpu,
                                 base_gemm=kind == TABLE)
    # the INT8 GEMM itself needs no rows (its fused SwiGLU fc2 two); an adapter's plain GEMMs
    # keep the generic rule
    base = None
    if kind == ANY and not ranks:
        base = INT8_FUSED_FC2_MIN_ROWS if name == "fc2" else 1
    return PhaseRule(floor, reason, base)


def phase_rule(table: GemmTable | None, shapes: Mapping[str, tuple[int, int]],
               ranks: Mapping[str, tuple[int, ...]], linears: tuple[str, ...], *, where: str,
               gpu: bool = True, formats: Mapping[str, str] | None = None,
               nvidia: bool = True) -> PhaseRule:
    """`PhaseRule.combine` of `linears` (their weight `formats`, default plain)."""
    formats = formats or {}
    return PhaseRule.combine([
        linear_rule(table, name, *shapes[name], tuple(ranks.get(name, ())), where=where,
                    gpu=gpu, weight_format=formats.get(name, "bfloat16"), nvidia=nvidia)
        for name in linears])


def linear_floor(table: GemmTable | None, name: str, k: int, n: int, ranks: tuple[int, ...],
                 *, where: str, gpu: bool = True, base_gemm: bool = True
                 ) -> tuple[int | None, str]:
    """(floor, why) for plain weights: rows per call from which `name` (K->N, with adapters of
    `ranks`) is known exact, beyond the EXACT_MIN_ROWS every linear keeps; 0 when only that
    applies; None with the reason when no floor is known. where: the GPU model and dtype, for
    the reason. base_gemm=False: only the adapters' GEMMs (the weight's own is INT8 ConvRot)."""
    floor = 0
    if table is not None and base_gemm:
        listed, value = table.lookup(k, n)
        if listed and value is None:
            return None, f"{name} {k}->{n} is never exact in row slices on {where}"
        floor = value or 0
    for rank in ranks:
        lora = f"on-activation LoRA on {name}, rank {rank}" if rank else \
            f"an on-activation adapter without a LoRA rank on {name}"
        if table is None:
            if gpu:
                return None, f"{lora}: no row floor measured on {where}"
            continue  # CPU stand-in: the generic rule
        if not rank:
            return None, lora
        for kk, nn in ((k, rank), (rank, n)):
            listed, value = table.lookup(kk, nn)
            if not listed:
                return None, f"{lora}: no row floor measured on {where}"
            if value is None:
                return None, lora
            floor = max(floor, value)
    return floor, ""


def phase_floor(table: GemmTable | None, shapes: Mapping[str, tuple[int, int]],
                ranks: Mapping[str, tuple[int, ...]], linears: tuple[str, ...], *, where: str,
                gpu: bool = True) -> tuple[int | None, str]:
    """The largest floor of `linears` with plain weights (None and the first reason when one
    has none); `phase_rule` for other weight formats."""
    rule = phase_rule(table, shapes, ranks, linears, where=where, gpu=gpu)
    return rule.floor, rule.why
