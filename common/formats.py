"""What a block's linears are (weight format, adapters that run on them) and the row floors
that follow on this GPU model (`exact_rows`). ComfyUI's names are read through `comfy_seam.h3`."""

from __future__ import annotations

from functools import cache

import torch

from ..comfy_seam import h3 as seam_h3
from ..common import exact_rows
from ..common import floors as common_floors
from .row_exactness import RowFloors


def block_linears(block: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """An H3 block's four big linears by the names `exact_rows` uses."""
    attn, mlp = block.attn, block.mlp
    return {"qkv_proj": attn.qkv_proj, "out_proj": attn.out_proj, "fc1": mlp.fc1,
            "fc2": mlp.fc2}


def block_adapter_ranks(block: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The ranks of the on-activation adapters that RUN on each of the block's linears: fc2's
    do not where the MLP's fused INT8 path never calls `fc2.forward`."""
    ranks = {name: seam_h3.activation_adapter_ranks(module)
             for name, module in block_linears(block).items()}
    if ranks.get("fc2") and seam_h3.fused_int8_fc2(block):
        ranks["fc2"] = ()
    return ranks


def skipped_adapter_note(block: torch.nn.Module) -> str:
    """The status note when fc2 carries an on-activation adapter upstream does not run."""
    if seam_h3.activation_adapter_ranks(block.mlp.fc2) and seam_h3.fused_int8_fc2(block):
        return ("fc2's on-activation LoRA does not run (upstream's INT8 MLP computes fc2 in "
                "linear_input_act, not fc2.forward): the pack computes what upstream does")
    return ""


def activation_adapters(linear: torch.nn.Module) -> tuple[int, int]:
    """(count, largest rank) of on-activation adapters wrapped around `linear.forward`."""
    ranks = seam_h3.activation_adapter_ranks(linear)
    return len(ranks), max(ranks, default=0)


@cache
def device_name(device: torch.device) -> str:
    """The GPU model as `exact_rows.json` names it ("cpu" for the CPU)."""
    if device.type == "cpu":
        return exact_rows.CPU
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


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


def block_floors(linears: dict[str, torch.nn.Module], device: torch.device, dtype: torch.dtype,
                 ranks: dict[str, tuple[int, ...]],
                 formats: dict[str, str] | None = None) -> RowFloors:
    """Row floors of a block's two chunked phases, from its linears' shapes, weight formats
    (default: read off the weights) and the ranks of the adapters that run on them."""
    name = device_name(device)
    dtype_name = str(dtype).removeprefix("torch.")
    table = exact_rows.table_for(name, dtype_name)  # of the compute dtype (plain GEMMs)
    shapes = {key: linear_shape(module) for key, module in linears.items()}
    formats = {key: seam_h3.weight_format(module) for key, module in linears.items()} \
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
        f"{common_floors.EXACT_MIN_ROWS:,} rows are taken as exact, as measured on other GPUs; "
        "dev/bench/sweep_chunk_exactness.py measures this one")
    return RowFloors.of_rules(found["qkv"], found["ffn"], assumed=assumed)
