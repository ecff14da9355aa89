"""The H3 Multi-GPU node's check of its MODEL input, before any placement or weight move.

UNETLoader loads whatever file it is given: a Flux or Wan DiT, or an H3 file whose quantization
metadata does not match its weights, reaches this node as a working MODEL. Placing it would
clone and reload it on another GPU (minutes for 20 GB) and fail later inside a sampler step,
or (metadata that mislabels the weights) compute garbage. So the node refuses first, naming
what it got and the file it came from:

1. the model must be ComfyUI's `comfy.model_base.MiniMaxH3` where that class exists;
2. its diffusion model must have the `blocks[i].attn` the pack's features place and patch;
3. the file ComfyUI loaded it from, when the patcher records it, is checked by
   `checkpoint_check.check_dit_file` (header and quantization only, never the weights).

A file that is truncated or whose `comfy_quant` JSON is unreadable never gets here: ComfyUI's
UNETLoader fails reading it first (what it says is in `checkpoint_check`'s docstring). The pack
cannot intercept that: the file name reaches ComfyUI's loader, not a node of the pack.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..planner.checkpoint_check import FORMATS, H3_DIT_FILE, check_dit_file

# torch storage dtype (as str(dtype) writes it) -> how a safetensors header names it
_STORED = {"torch.int8": {"I8"}, "torch.uint8": {"U8"}, "torch.float8_e4m3fn": {"F8_E4M3", "U8"},
           "torch.float8_e5m2": {"F8_E5M2", "U8"}, "torch.bfloat16": {"BF16"},
           "torch.float16": {"F16"}}


def comfy_formats() -> dict[str, tuple[frozenset[str], frozenset[str]]] | None:
    """The quantization formats of the running ComfyUI for `check_quantization`, from
    `comfy.quant_ops.QUANT_ALGOS` (ComfyUI internal; read on 0.33.0 and the newest files:
    name -> {"storage_t": torch dtype, ...}); None without it. The scales each format requires
    are the pack's table (`FORMATS`), since QUANT_ALGOS lists optional ones too."""
    from ..comfy_seam.h3 import quant_algos

    algos = quant_algos()
    if algos is None:
        return None
    out = {}
    for name, algo in algos.items():
        stored = _STORED.get(str(algo.get("storage_t")) if isinstance(algo, dict) else "")
        required = FORMATS.get(name, (frozenset(), frozenset()))[1]
        out[name] = (frozenset(stored or ()), required)  # unknown storage: not checked
    return out


def model_file(model: Any) -> str | None:
    """The .safetensors file ComfyUI loaded this MODEL from, or None: the patcher's
    `cached_patcher_init` (ComfyUI internal; 0.33.0 and the newest files set it in
    `comfy.sd.load_diffusion_model` to `(load_diffusion_model, (path, model_options))` and in
    the checkpoint loader to `(loader, (path, ...), index)`), kept by `clone()`."""
    init = getattr(model, "cached_patcher_init", None)
    with contextlib.suppress(TypeError, IndexError, KeyError):
        path = init[1][0]
        if isinstance(path, str) and path.lower().endswith((".safetensors", ".sft")):
            return path
    return None


def _h3_class() -> type | None:
    """`comfy.model_base.MiniMaxH3` (ComfyUI internal; 0.33.0 and the newest files), or None
    on a ComfyUI without H3 or outside ComfyUI (the twin in tests)."""
    from ..comfy_seam.h3 import h3_model_class

    return h3_model_class()


def h3_model_problem(model: Any) -> str | None:
    """Why `model` is not an H3 DiT this pack can place, naming what it is; None when it is."""
    source = model_file(model)
    came = f" (loaded from {os.path.basename(source)})" if source else ""
    fix = f"connect the H3 DiT: UNETLoader with {H3_DIT_FILE}"
    base = getattr(model, "model", None)
    if base is None:
        return f"the model input is a {type(model).__name__}, not a ComfyUI MODEL; {fix}"
    h3 = _h3_class()
    if h3 is not None and not isinstance(base, h3):
        kind = type(base)
        return (f"the model input is {kind.__name__} ({kind.__module__}.{kind.__qualname__})"
                f"{came}, not MiniMax H3; {fix}")
    dit = getattr(base, "diffusion_model", None)
    blocks = getattr(dit, "blocks", None)
    try:
        has_blocks = len(blocks) > 0 and hasattr(blocks[0], "attn")
    except TypeError:
        has_blocks = False
    if not has_blocks:
        return (f"the model input's diffusion model ({type(dit).__name__}){came} has no H3 DiT "
                f"blocks (blocks[i].attn), which this pack places and patches; {fix}")
    return None


def check_h3_model(model: Any) -> None:
    """ValueError naming what the MODEL is and the file it came from, unless it is an intact
    H3 DiT; reads the file's header (and its layers' comfy_quant bytes), never its weights."""
    problem = h3_model_problem(model)
    if problem:
        raise ValueError(problem)
    path = model_file(model)
    if path is not None and os.path.isfile(path):
        check_dit_file(path, comfy_formats())
