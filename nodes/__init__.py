"""The pack's ComfyUI nodes (V3) and the plain logic behind them.

The plain modules (devices, placement, inputs, status, planning, features, attention_override)
import without ComfyUI and are tested on CPU. The V3 node modules (v3_*, extension,
comfy_types) import `comfy_api.latest` and are loaded only when ComfyUI asks for
`H3MultiGPUExtension`, so `import h3_multigpu.nodes` works everywhere.
"""

from __future__ import annotations

from typing import Any

# Node ids, in the order the extension lists them (checked against the classes in tests).
NODE_IDS = (
    "H3MultiGPU",
    "H3MultiGPUAdvanced",
    "H3MultiGPUPlan",
    "H3MultiGPUSeconds",
    "H3MultiGPUShowText",
    "H3MultiGPUReleaseCLIP",
    "H3MultiGPUDualSage",
    "H3MultiGPUDualSageAdvanced",
    "H3MultiGPUChunking",
    "H3MultiGPUChunkingAdvanced",
    "H3MultiGPUPrefetch",
    "H3MultiGPUPrefetchAdvanced",
    "H3MultiGPUSageAttention",
    "H3MultiGPUUpscalerDevice",
    "H3MultiGPUKeyframesToSize",
    "H3MultiGPUVideoDecode",
    "H3MultiGPULatentUpscalerLoader",
    "H3MultiGPULatentUpscale",
)


def __getattr__(name: str) -> Any:
    # Lazy: the extension needs comfy_api, which only exists inside ComfyUI.
    if name == "H3MultiGPUExtension":
        from .extension import H3MultiGPUExtension

        return H3MultiGPUExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
