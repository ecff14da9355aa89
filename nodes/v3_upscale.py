"""The pack's latent upscale: load the community H3 upscaler and run it on a PASS1 latent.

Core ComfyUI's `MiniMaxH3LatentUpscaleWithModel` is newer than most H3-capable ComfyUI
versions, and their `LatentUpscaleModelLoader` loads only HunyuanVideo 1.5 and LTX upscalers.
These two nodes need neither, so the bundled two-pass workflows run on any ComfyUI that has the
MiniMax H3 nodes. The network and its checks live in `upscale/`; here is only ComfyUI glue
(model folder, ModelPatcher for device placement and offload, the node schemas).

The upscaler loads through the patcher class ComfyUI uses for its own models
(`comfy.model_patcher.CoreModelPatcher`, which main.py makes `ModelPatcherDynamic` under
DynamicVRAM), so ComfyUI frees memory for it the dynamic way instead of evicting the text
encoder and VAEs from gpu:0; and it registers a reload factory (`cached_patcher_init`), so
placing it on another GPU is core's `deepclone_multigpu`. Neither ComfyUI 0.33.0 nor the newest
stored files have a core H3 latent upscale node (their `LatentUpscaleModelLoader` knows the
HunyuanVideo 1.5 and LTX upscalers only).
"""

from __future__ import annotations

from comfy_api.latest import io

from ..comfy_seam import core_nodes, files, models
from ..common.geometry import MAX_CANVAS_SIDE as SIZE_MAX
from ..common.geometry import validate_canvas
from ..planner.checkpoint_check import read_checkpoint
from .comfy_types import CATEGORY, LatentUpscaleModel
from .status import CORE_UPSCALE as CORE_UPSCALE_NODE

FOLDER = "latent_upscale_models"


class PackUpscaler:
    """The loaded network behind a ModelPatcher: `.patcher` is what placement retargets."""

    def __init__(self, patcher, name: str):
        self.patcher = patcher
        self.name = name

    @property
    def load_device(self):
        return self.patcher.load_device


def load_upscaler_patcher(path: str, disable_dynamic: bool = False):
    """The upscaler checkpoint at `path` in ComfyUI's patcher class for models, with itself as
    the reload factory (`cached_patcher_init`: ComfyUI calls it for multi-GPU clones, with
    disable_dynamic=True for a non-dynamic one)."""
    import torch

    from ..upscale import build_from_state_dict

    if path.lower().endswith((".safetensors", ".sft")):
        read_checkpoint(path, "latent upscaler")  # a truncated or foreign file, named first
    sd = files.load_torch_file(path)
    try:
        net = build_from_state_dict(sd)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    device = models.torch_device()
    # fp16 as published on a GPU that runs it; fp32 on the CPU (no half conv3d there).
    net = net.to(torch.float16 if models.should_use_fp16(device) else torch.float32)
    patcher = models.patcher_class(disable_dynamic)(net, load_device=device,
                                                    offload_device=models.offload_device())
    patcher.cached_patcher_init = (load_upscaler_patcher, (path,))
    return patcher


def _folder_files() -> list[str]:
    # Older ComfyUI has no such folder: the seam adds models/latent_upscale_models first.
    return files.model_files(FOLDER)


class H3MultiGPULatentUpscalerLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPULatentUpscalerLoader",
            display_name="H3 Load Latent Upscaler",
            category=CATEGORY,
            description="Loads the MiniMax H3 learned latent upscaler "
                        "(minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors) from "
                        "models/latent_upscale_models, on any ComfyUI with the H3 nodes.",
            inputs=[io.Combo.Input("upscaler_name", options=_folder_files(),
                                   tooltip="A file in models/latent_upscale_models.")],
            outputs=[LatentUpscaleModel.Output(display_name="latent_upscale_model")],
        )

    @classmethod
    def execute(cls, upscaler_name) -> io.NodeOutput:
        path = files.model_path(FOLDER, upscaler_name)
        return io.NodeOutput(PackUpscaler(load_upscaler_patcher(path), upscaler_name))


class H3MultiGPULatentUpscale(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPULatentUpscale",
            display_name="H3 Latent Upscale",
            category=CATEGORY,
            description="Resizes the video part of an H3 latent to width x height pixels with "
                        "the learned upscaler (audio kept, noise mask dropped). Give the PASS2 "
                        "size: 864x480 -> 1312x736 (a 1.5x factor would round to 1280x704).",
            inputs=[
                LatentUpscaleModel.Input("model", tooltip="From H3 Load Latent Upscaler (placed "
                                         "on the helper GPU by H3 Multi-GPU)."),
                io.Latent.Input("samples", tooltip="The PASS1 latent (video + audio)."),
                io.Int.Input("width", default=1312, min=32, max=SIZE_MAX, step=32,
                             tooltip="Target width in pixels (latent = width // 16)."),
                io.Int.Input("height", default=736, min=32, max=SIZE_MAX, step=32,
                             tooltip="Target height in pixels (latent = height // 16)."),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def validate_inputs(cls, width=None, height=None):
        if width is None or height is None:
            return True  # linked: checked when it runs
        try:
            validate_canvas(width, height)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model, samples, width, height) -> io.NodeOutput:
        validate_canvas(width, height)
        if isinstance(model, PackUpscaler):
            from ..upscale import upscale_latent

            models.load([model.patcher])
            out = upscale_latent(model.patcher.model, samples, width, height,
                                 device=model.patcher.load_device)
            return io.NodeOutput(out)
        core = core_nodes.node_class(CORE_UPSCALE_NODE)
        if core is None:
            raise ValueError("this LATENT_UPSCALE_MODEL was not loaded by 'H3 Load Latent "
                             "Upscaler'; load minimax_h3_latent_upscaler_3d_conv_v1_fp16."
                             "safetensors with that node")
        # A model from core's loader on a ComfyUI that has the core H3 upscale: let it run it.
        return core.execute(model=model, samples=samples, width=width, height=height)


NODES = [H3MultiGPULatentUpscalerLoader, H3MultiGPULatentUpscale]
