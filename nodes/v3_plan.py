"""V3 nodes around the plan: the Plan node, seconds -> frames, text display, text encoder release.

Imported only inside ComfyUI (comfy_api at module level); the logic they call is in plain
modules tested on CPU.
"""

from __future__ import annotations

from comfy_api.latest import io

from . import inputs
from .comfy_types import CATEGORY, Plan, preview_text
from .devices import gpu_inventory
from .placement import placement_from_plan, should_release_text_encoder
from .planning import comfy_loader_inputs, make_plan, profiles

SIZE_MAX = 4096


def size_inputs() -> list:
    """PASS2 and PASS1 canvas inputs, shared by the Plan node and the drop-in."""
    tip = "pixels, a multiple of 32 (latent = pixels/16 and the DiT's 2x2 patch needs it even)"
    return [
        io.Int.Input("pass2_width", default=1312, min=32, max=SIZE_MAX, step=32,
                     tooltip=f"PASS2 (final) width in {tip}. 1312x736 is 864x480 x ~1.52."),
        io.Int.Input("pass2_height", default=736, min=32, max=SIZE_MAX, step=32,
                     tooltip=f"PASS2 (final) height in {tip}."),
        io.Int.Input("pass1_width", default=864, min=32, max=SIZE_MAX, step=32,
                     tooltip=f"PASS1 (draft) width in {tip}."),
        io.Int.Input("pass1_height", default=480, min=32, max=SIZE_MAX, step=32,
                     tooltip=f"PASS1 (draft) height in {tip}."),
        io.Float.Input("seconds", default=5.0, min=0.25, max=60.0, step=0.25,
                       tooltip="Clip length; snapped up to H3's 17k+5 frame grid at 24 fps: "
                               "5 s = 124, 10 s = 243, 12 s = 294, 15 s = 362 frames."),
        io.Combo.Input("devices", options=["auto", *profiles()], default="auto",
                       tooltip="'auto' plans for this machine's GPUs; a profile name plans for "
                               "that hardware (to preview a machine you do not have)."),
        io.Int.Input("lora_rank", default=128, min=0, max=1024,
                     tooltip="Rank of a LoRA applied on activations (the turbo LoRA): it adds "
                             "one activation-sized tensor per adapted linear. 0 = no LoRA."),
    ]


def cfg_inputs() -> list:
    """The guidance scale of each pass (the Plan node): above 1 a step makes two model calls,
    and the plan weighs ComfyUI's MultiGPU CFG Split against the pack's modes."""
    tip = ("guidance scale (cfg) of the pass's sampler: 1 = one model call a step (the turbo "
           "LoRA's); above 1 two, and the plan weighs ComfyUI's MultiGPU CFG Split too.")
    return [io.Float.Input("pass1_cfg", default=1.0, min=0.0, max=100.0, step=0.1,
                           optional=True, tooltip=f"PASS1 {tip}"),
            io.Float.Input("pass2_cfg", default=1.0, min=0.0, max=100.0, step=0.1,
                           optional=True, tooltip=f"PASS2 {tip}")]


PARALLEL_TIP = ("How the GPUs share each sampling step: 'auto' picks per pass the fastest of "
                "sequence parallel (every GPU runs every block on part of the tokens), heads "
                "(Dual-Sage: attention heads split) and one GPU, by predicted time; or force "
                "one. All are exact.")


def parallel_input():
    return io.Combo.Input("parallel", options=["auto", "sequence", "heads", "off"],
                          default="auto", optional=True, tooltip=PARALLEL_TIP)


def check_sizes(pass2_width=None, pass2_height=None, pass1_width=None, pass1_height=None,
                seconds=None, devices=None, lora_rank=None) -> str | bool:
    """validate_inputs body: linked inputs arrive as None and are checked when they run."""
    sizes = (pass1_width, pass1_height, pass2_width, pass2_height)
    return inputs.first_message(
        inputs.check_two_pass(*sizes) if None not in sizes else None,
        inputs.check_seconds(seconds) if seconds is not None else None,
        inputs.check_profile(devices, profiles()) if devices is not None else None,
        f"lora_rank={lora_rank} must be >= 0" if lora_rank is not None and lora_rank < 0
        else None,
    )


class H3MultiGPUPlan(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUPlan",
            display_name="H3 Multi-GPU Plan",
            category=CATEGORY,
            description="Plans the two-pass H3 job: whether it fits and how long the whole "
                        "job takes (the report's first line), each GPU's memory peak, how the "
                        "GPUs share each pass, chunking and streamed blocks, timed with the "
                        "attention this ComfyUI runs.",
            inputs=[*size_inputs(), *cfg_inputs()],
            outputs=[Plan.Output(display_name="plan"),
                     io.String.Output(display_name="report")],
        )

    @classmethod
    def validate_inputs(cls, pass2_width=None, pass2_height=None, pass1_width=None,
                        pass1_height=None, seconds=None, devices=None, lora_rank=None):
        # Named (not **kwargs) so ComfyUI still range-checks every input not listed here.
        return check_sizes(pass2_width, pass2_height, pass1_width, pass1_height, seconds,
                           devices, lora_rank)

    @classmethod
    def execute(cls, pass2_width, pass2_height, pass1_width, pass1_height, seconds, devices,
                lora_rank, pass1_cfg=1.0, pass2_cfg=1.0) -> io.NodeOutput:
        plan = make_plan(pass2_width=pass2_width, pass2_height=pass2_height,
                         pass1_width=pass1_width, pass1_height=pass1_height, seconds=seconds,
                         devices=devices, lora_rank=lora_rank, pass1_cfg=pass1_cfg,
                         pass2_cfg=pass2_cfg,
                         **comfy_loader_inputs(devices))  # the loader this ComfyUI runs
        report = plan.report()
        return io.NodeOutput(plan, report, ui=preview_text(report))


class H3MultiGPUSeconds(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUSeconds",
            display_name="H3 Seconds to Frames",
            category=CATEGORY,
            description="Clip length in seconds -> H3's frame count (17k+5 at 24 fps), exact.",
            inputs=[io.Float.Input("seconds", default=5.0, min=0.25, max=60.0, step=0.25,
                                   tooltip="5 s = 124, 10 s = 243, 12 s = 294, 15 s = 362 frames "
                                           "(H3 was trained on 124..362).")],
            outputs=[io.Int.Output(display_name="frames"),
                     io.Float.Output(display_name="seconds",
                                     tooltip="The clip's real length: frames / 24.")],
        )

    @classmethod
    def validate_inputs(cls, seconds=None):
        return inputs.first_message(inputs.check_seconds(seconds) if seconds is not None
                                    else None)

    @classmethod
    def execute(cls, seconds) -> io.NodeOutput:
        frames, real = inputs.seconds_to_frames(seconds)
        return io.NodeOutput(frames, real)


class H3MultiGPUShowText(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUShowText",
            display_name="H3 Multi-GPU Show Status",
            category=CATEGORY,
            description="Shows a status or plan report on the graph (an output node, so the "
                        "text is produced even when nothing else consumes it).",
            inputs=[io.String.Input("text", force_input=True)],
            outputs=[io.String.Output(display_name="text")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, text) -> io.NodeOutput:
        return io.NodeOutput(text, ui=preview_text(text))


class H3MultiGPUReleaseCLIP(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUReleaseCLIP",
            display_name="H3 Release Text Encoder",
            category=CATEGORY,
            description="Passes the conditioning through and, after the prompt is encoded, "
                        "unloads the text encoder from its GPU when the plan needs the room.",
            inputs=[
                io.Conditioning.Input("conditioning"),
                io.Clip.Input("clip", tooltip="The text encoder that made the conditioning."),
                io.Combo.Input("release", options=["auto", "always", "never"], default="auto",
                               tooltip="auto: release when the helper GPU cannot hold it beside "
                                       "its later work (from the plan)."),
                Plan.Input("plan", optional=True),
            ],
            outputs=[io.Conditioning.Output(display_name="conditioning"),
                     io.String.Output(display_name="status")],
        )

    @classmethod
    def execute(cls, conditioning, clip, release, plan=None) -> io.NodeOutput:
        from .comfy_placement import release_text_encoder

        placement = placement_from_plan(plan, gpu_inventory())
        do_release, why = should_release_text_encoder(release, plan, placement)
        status = why
        if do_release:
            status = f"{release_text_encoder(clip)}: {why}"
        return io.NodeOutput(conditioning, status, ui=preview_text(status))


NODES = [H3MultiGPUPlan, H3MultiGPUSeconds, H3MultiGPUShowText, H3MultiGPUReleaseCLIP]
