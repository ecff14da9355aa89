"""What core ComfyUI lacks for a two-GPU two-pass H3 graph wired by hand.

- a device choice for the LATENT_UPSCALE_MODEL (core has one for MODEL, CLIP and VAE only);
- PASS2 keyframes at PASS2's size: the first/last-frame latents that MiniMaxH3ImageToVideo
  puts in the conditioning are encoded at PASS1's canvas and no longer match the upscaled
  latent, so image-to-video's PASS2 needs them re-encoded at the new size.
"""

from __future__ import annotations

from comfy_api.latest import io

from .comfy_types import CATEGORY, LatentUpscaleModel, gpu_device_options, preview_text
from .devices import parse_device
from .inputs import frames_for_latent

KEYFRAMES_KEY = "minimax_keyframes"  # where core's H3 nodes keep first/last-frame latents


class H3MultiGPUUpscalerDevice(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUUpscalerDevice",
            display_name="H3 Select Latent Upscaler Device",
            category=CATEGORY,
            description="Places a LATENT_UPSCALE_MODEL on a GPU (core ComfyUI offers a device "
                        "choice for MODEL, CLIP and VAE only).",
            inputs=[
                LatentUpscaleModel.Input("latent_upscale_model"),
                io.Combo.Input("device", options=gpu_device_options(), default="default",
                               tooltip="ComfyUI's device names: gpu:0 is the first GPU."),
            ],
            outputs=[LatentUpscaleModel.Output(display_name="latent_upscale_model"),
                     io.String.Output(display_name="status")],
        )

    @classmethod
    def validate_inputs(cls, device=None):
        # Unknown gpu:N is allowed (a workflow made on a bigger machine); execute says so.
        if device is None:
            return True
        try:
            parse_device(device)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, latent_upscale_model, device) -> io.NodeOutput:
        from .comfy_placement import place_upscaler
        from .devices import gpu_inventory

        choice = parse_device(device)
        count = len(gpu_inventory())
        if choice in ("auto", "cpu"):
            status = f"latent upscaler: left where its loader put it ({device})"
        elif choice >= count:
            status = (f"latent upscaler: gpu:{choice} does not exist ({count} GPUs); left where "
                      f"its loader put it")
        else:
            latent_upscale_model, status = place_upscaler(latent_upscale_model, choice)
        return io.NodeOutput(latent_upscale_model, status, ui=preview_text(status))


class H3MultiGPUKeyframesToSize(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUKeyframesToSize",
            display_name="H3 Keyframes to Latent Size",
            category=CATEGORY,
            description="Re-encodes the first/last frame of image-to-video conditioning at the "
                        "size of the given latent, so PASS2 at the upscaled size keeps its "
                        "anchors (the text conditioning is reused, not re-encoded).",
            inputs=[
                io.Conditioning.Input("positive"),
                io.Vae.Input("vae", tooltip="The video VAE."),
                io.Latent.Input("latent", tooltip="The upscaled AV latent PASS2 samples."),
                io.Image.Input("first_frame", optional=True),
                io.Image.Input("last_frame", optional=True),
            ],
            outputs=[io.Conditioning.Output(display_name="positive")],
        )

    @classmethod
    def execute(cls, positive, vae, latent, first_frame=None, last_frame=None) -> io.NodeOutput:
        from ..comfy_seam import core_nodes

        samples = latent["samples"]
        video = samples.tensors[0] if getattr(samples, "is_nested", False) else samples
        height, width = video.shape[3] * 16, video.shape[4] * 16
        frame_count = frames_for_latent(video.shape[2])

        def fit(image, crop: str):
            # Same fitting as the first pass: the first frame is stretched, the last cropped.
            pixels = image[:1, :, :, :3].movedim(-1, 1)
            pixels = core_nodes.resize_image(pixels, width, height, "lanczos", crop)
            return pixels.movedim(1, -1)

        keyframes = []
        if first_frame is not None:
            keyframes.append({"resolved_frame_index": 0,
                              "latent": vae.encode(fit(first_frame, "disabled"))})
        if last_frame is not None:
            keyframes.append({"resolved_frame_index": frame_count - 1,
                              "latent": vae.encode(fit(last_frame, "center"))})
        # Replace (not extend) the PASS1-sized keyframes; text conditioning stays as it was.
        positive = core_nodes.conditioning_set_values(positive, {KEYFRAMES_KEY: keyframes})
        return io.NodeOutput(positive)


NODES = [H3MultiGPUUpscalerDevice, H3MultiGPUKeyframesToSize]
