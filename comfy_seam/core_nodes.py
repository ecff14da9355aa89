"""ComfyUI's own nodes and node helpers, as the pack's nodes use them: its node registry, the
core multi-GPU device nodes, conditioning values, image resize.

Each function names the ComfyUI internal it calls and the releases it was read on (0.33.0 and
the newest files; each in `internals.INTERNALS`); inside ComfyUI only, except `node_classes`,
which answers None outside it.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import runtime

NODE_HELPERS = "node_helpers"  # ComfyUI's top-level module of conditioning helpers
COMFY_NODES = "nodes"  # ComfyUI's top-level module with NODE_CLASS_MAPPINGS


def node_classes() -> dict[str, Any] | None:
    """ComfyUI's `nodes.NODE_CLASS_MAPPINGS` (every node class it registered) when ComfyUI has
    imported it, else None (never imported here: outside ComfyUI a top-level `nodes` may be
    another package)."""
    return getattr(runtime.comfy_nodes(), "NODE_CLASS_MAPPINGS", None)


def node_class(node_id: str) -> Any:
    """ComfyUI's node class `node_id` or None; imports ComfyUI's `nodes` (called from a node's
    execute, inside ComfyUI, where it is imported already)."""
    return importlib.import_module(COMFY_NODES).NODE_CLASS_MAPPINGS.get(node_id)


def multigpu_node(name: str) -> Any:
    """A core multi-GPU node class (`comfy_extras.nodes_multigpu`: SelectModelDeviceNode,
    SelectCLIPDeviceNode, SelectVAEDeviceNode; 0.33.0), or None on a ComfyUI without them (the
    newest-files bed serves 0.3.64's comfy_extras) or outside ComfyUI."""
    return getattr(runtime.nodes_multigpu(), name, None)


def conditioning_set_values(conditioning: Any, values: dict) -> Any:
    """`node_helpers.conditioning_set_values(conditioning, values)`: a copy of every entry of
    the conditioning with `values` set (replaced, not appended) in its options."""
    return importlib.import_module(NODE_HELPERS).conditioning_set_values(conditioning, values)


def resize_image(pixels_BCHW: Any, width: int, height: int, method: str, crop: str) -> Any:
    """`comfy.utils.common_upscale(pixels, width, height, method, crop)`: ComfyUI's resize (and
    centre crop) of a [B, C, H, W] image batch, as its image-to-video nodes fit a frame."""
    return runtime.utils().common_upscale(pixels_BCHW, width, height, method, crop)
