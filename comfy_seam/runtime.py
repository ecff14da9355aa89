"""ComfyUI's modules, for the seam's calls of its public functions (model management, utils,
the patcher classes, the model and quantization registries). Each returns the module, or None
outside ComfyUI (the CLI, the twin tests); the seam functions that call them name the functions
they call, and `internals.INTERNALS` lists every one with the releases it was checked on.

`model_management()` is the one accessor of `comfy.model_management`. It never imports it
unless asked (`importing=True`): ComfyUI imports it before any custom node loads, so inside
ComfyUI both answers are the same module, while outside (the CLI, the CPU tests, the benches)
importing it would start ComfyUI's device setup wherever a ComfyUI is on the path. Only the
seam functions that serve the nodes and the split decode, which run inside ComfyUI alone and
imported it before the seam had one accessor, ask for the import."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


MODEL_MANAGEMENT = "comfy.model_management"


def model_management(*, importing: bool = False) -> ModuleType | None:
    """`comfy.model_management` if ComfyUI has imported it (with `importing`: imported here
    when it has not, None where it does not import); see the module docstring."""
    if importing:
        return _module(MODEL_MANAGEMENT)
    return sys.modules.get(MODEL_MANAGEMENT)


def utils() -> ModuleType | None:
    """`comfy.utils` (load_torch_file, common_upscale, ProgressBar)."""
    return _module("comfy.utils")


def model_patcher() -> ModuleType | None:
    """`comfy.model_patcher` (ModelPatcher, CoreModelPatcher, LowVramPatch)."""
    return _module("comfy.model_patcher")


def model_base() -> ModuleType | None:
    """`comfy.model_base` (MiniMaxH3)."""
    return _module("comfy.model_base")


def quant_ops() -> ModuleType | None:
    """`comfy.quant_ops` (QUANT_ALGOS, QuantizedTensor)."""
    return _module("comfy.quant_ops")


def nodes_multigpu() -> ModuleType | None:
    """`comfy_extras.nodes_multigpu` (the core Select*Device nodes)."""
    return _module("comfy_extras.nodes_multigpu")


def multigpu() -> ModuleType | None:
    """`comfy.multigpu` (create_multigpu_deepclones: what MultiGPU CFG Split runs)."""
    return _module("comfy.multigpu")


def comfy_nodes() -> ModuleType | None:
    """ComfyUI's `nodes` module (its NODE_CLASS_MAPPINGS registry) when ComfyUI has imported
    it; never imported here: outside ComfyUI a top-level `nodes` may be another package."""
    module = sys.modules.get("nodes")
    return module if hasattr(module, "NODE_CLASS_MAPPINGS") else None


def loaded_optimized_attention() -> Any:
    """ComfyUI's `optimized_attention` as the H3 model module imported it (a module global of
    comfy.ldm.modules.attention set at import by the startup flags, which the H3 module imports
    by name, so its copy is what its blocks call), else the attention module's; None before
    ComfyUI imported them (read only, never imported here)."""
    for name in ("comfy.ldm.minimax.model", "comfy.ldm.modules.attention"):
        function = getattr(sys.modules.get(name), "optimized_attention", None)
        if function is not None:
            return function
    return None
