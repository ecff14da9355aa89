"""Video decode on several GPUs: VAE in, the same VAE patched out, plus a status line.

Thin: parses the node's strings into `MultiGPUDecodeConfig` and calls the library's
`apply_multi_gpu_decode` (an object patch on the VAE's window loop). The stock VAE Decode node
then decodes on every GPU listed, bit-identical to one GPU.
"""

from __future__ import annotations

from comfy_api.latest import io

from .comfy_types import CATEGORY, preview_text


def decode_config(helpers: str, shares: str, make_room: bool):
    from ..decode.apply import MultiGPUDecodeConfig

    return MultiGPUDecodeConfig.from_strings(helpers=helpers, shares=shares, make_room=make_room)


def apply_decode(vae, config) -> tuple[object, str]:
    from ..decode.apply import apply_multi_gpu_decode

    patched, line = apply_multi_gpu_decode(vae, config)
    return patched, f"decode: {line}"


class H3MultiGPUVideoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUVideoDecode", display_name="H3 Multi-GPU Video Decode",
            category=CATEGORY,
            description="Shares the H3 video VAE's decode windows between its GPU and helper "
                        "GPUs (cut every 5 latent frames, one 5-frame cross-fade handed over per "
                        "cut). Connect the VAE it returns to VAE Decode. Exact: same video as "
                        "one GPU, bit for bit.",
            inputs=[
                io.Vae.Input("vae", tooltip="The H3 video VAE (after any device choice)."),
                io.String.Input("helpers", default="auto",
                                tooltip="GPUs that take windows besides the VAE's, e.g. 'gpu:1'; "
                                        "auto = every other GPU."),
                io.String.Input("shares", default="auto",
                                tooltip="Relative speeds, the VAE's GPU first, e.g. '1:0.6' for "
                                        "a slower helper; auto = equal. Needs explicit helpers."),
                io.Boolean.Input("make_room", default=True,
                                 tooltip="Let ComfyUI unload models (the DiT) from a helper GPU "
                                         "when the decoder copy (~5 GB) does not fit beside them."),
            ],
            outputs=[io.Vae.Output(display_name="vae"),
                     io.String.Output(display_name="status")],
        )

    @classmethod
    def validate_inputs(cls, helpers=None, shares=None, make_room=None):
        if helpers is None or shares is None:
            return True
        try:
            decode_config(helpers, shares, True)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, vae, helpers, shares, make_room=True) -> io.NodeOutput:
        patched, status = apply_decode(vae, decode_config(helpers, shares, make_room))
        return io.NodeOutput(patched, status, ui=preview_text(status))


NODES = [H3MultiGPUVideoDecode]
