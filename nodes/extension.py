"""The pack's ComfyExtension: every node, for ComfyUI's V3 entry point."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import v3_decode, v3_dropin, v3_features, v3_plan, v3_upscale, v3_utils


def all_nodes() -> list[type[io.ComfyNode]]:
    return [*v3_dropin.NODES, *v3_plan.NODES, *v3_features.NODES, *v3_utils.NODES,
            *v3_decode.NODES, *v3_upscale.NODES]


class H3MultiGPUExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return all_nodes()
