"""The pack's V3 custom types (imported only inside ComfyUI)."""

from __future__ import annotations

from comfy_api.latest import io

CATEGORY = "H3 Multi-GPU"

# The planner's Plan object travels between our nodes under this type.
Plan = io.Custom("H3_PLAN")

# Newest ComfyUI names the latent upscaler type; older ones do not, but the wire type
# string is the same, so a Custom type of that name connects to the core loader either way.
LatentUpscaleModel = getattr(io, "LatentUpscaleModel", None) or io.Custom("LATENT_UPSCALE_MODEL")


def preview_text(text: str):
    """UI payload that shows `text` on the node after it runs."""
    from comfy_api.latest import ui

    return ui.PreviewText(text)


def gpu_device_options() -> list[str]:
    """ComfyUI's own device list ("default", "cpu", "gpu:N"), or ours on older versions."""
    from ..comfy_seam.models import gpu_device_options as comfy_options

    options = comfy_options()
    if options is not None:
        return options
    from .devices import gpu_inventory

    return ["default", *(g.option for g in gpu_inventory())]
