"""The drop-in node: place every H3 component on its GPU and apply the plan's features.

MODEL, CLIP, both VAEs and the optional latent upscaler go in; the same come out placed
(DiT on the root GPU, the rest on the helper) with Dual-Sage, chunking and prefetch applied as
the plan says, plus a status text naming each feature, each GPU (index, name, memory) and the
predicted peaks. Without a PLAN input the node plans for the sizes on its own widgets.
"""

from __future__ import annotations

from comfy_api.latest import io

from .comfy_types import CATEGORY, LatentUpscaleModel, Plan, preview_text
from .devices import parse_device
from .features import apply_decode_plan, apply_plan
from .model_check import check_h3_model
from .placement import Placement, decide_placement, placement_from_plan
from .planning import PlannerUnavailable, comfy_loader_inputs, make_plan
from .server import gather
from .status import FEATURES, comfyui_support_line, compose_status, hooks_line
from .v3_plan import check_sizes, parallel_input, size_inputs


def _component_inputs() -> list:
    return [
        io.Model.Input("model", tooltip="The H3 DiT (UNETLoader, after any LoRA)."),
        io.Clip.Input("clip", tooltip="The H3 text encoder (CLIPLoader, type minimax)."),
        io.Vae.Input("vae", tooltip="The video VAE."),
        io.Vae.Input("audio_vae", tooltip="The audio VAE."),
        LatentUpscaleModel.Input("latent_upscale_model", optional=True,
                                 tooltip="The learned latent upscaler, placed on the helper GPU."),
        Plan.Input("plan", optional=True,
                   tooltip="A plan from H3 Multi-GPU Plan; without one this node plans for the "
                           "sizes below."),
    ]


def _outputs() -> list:
    return [
        io.Model.Output(display_name="model"),
        io.Clip.Output(display_name="clip"),
        io.Vae.Output(display_name="vae"),
        io.Vae.Output(display_name="audio_vae"),
        LatentUpscaleModel.Output(display_name="latent_upscale_model"),
        Plan.Output(display_name="plan"),
        io.String.Output(display_name="status"),
    ]


def run_dropin(model, clip, vae, audio_vae, latent_upscale_model, plan, sizes: dict,
               root_gpu: str = "auto", helper_gpu: str = "auto",
               disabled: tuple[str, ...] = (), prompt=None, node_id=None) -> tuple:
    """The drop-in's work, shared by the plain and the Advanced node. `prompt` / `node_id`:
    ComfyUI's hidden PROMPT and UNIQUE_ID, to name the graph's passes in the status."""
    from .comfy_placement import place_clip, place_model, place_upscaler, place_vae

    check_h3_model(model)  # a foreign or mislabelled DiT is named before anything moves
    server = gather(model, prompt, node_id)
    gpus = list(server.gpus)
    extra: list[str] = []
    support = _support_line(server)
    if not gpus:
        # nothing to place or share: the graph runs on ComfyUI's defaults; a profile still
        # gets its plan, as a preview of that hardware
        if plan is None and sizes["devices"] != "auto":
            plan = make_plan(**sizes, **_model_inputs(server))
        placement = placement_from_plan(None, gpus)
        status = compose_status(placement=placement, plan=plan, server=server,
                                inactive="this server has no GPU that ComfyUI computes on",
                                extra=[support] if support else None)
        return model, clip, vae, audio_vae, latent_upscale_model, plan, status, placement
    if plan is None:
        try:
            # planned for the loader this model runs with (DynamicVRAM or the legacy one)
            plan = make_plan(**sizes, **comfy_loader_inputs(sizes["devices"], model),
                             **_model_inputs(server))
        except PlannerUnavailable as exc:
            extra.append(f"planner: {exc}; default placement, no features applied")
    placement = placement_from_plan(plan, gpus)
    root, helper = parse_device(root_gpu), parse_device(helper_gpu)
    if isinstance(root, int) or isinstance(helper, int):
        placement = decide_placement(
            gpus, root=root if isinstance(root, int) else placement.root,
            helper=helper if isinstance(helper, int) else placement.helper)
    notes: list[str] = []
    if placement.root is not None:
        model, note = place_model(model, placement.root)
        notes.append(note)
        clip, note = place_clip(clip, placement.helper)
        notes.append(note)
        vae, note = place_vae(vae, placement.helper, "video VAE")
        notes.append(note)
        audio_vae, note = place_vae(audio_vae, placement.helper, "audio VAE")
        notes.append(note)
        if latent_upscale_model is not None:
            latent_upscale_model, note = place_upscaler(latent_upscale_model, placement.helper)
            notes.append(note)
        else:
            notes.append("latent upscaler: not connected")
    if plan is not None:
        model, lines = apply_plan(model, plan, placement, disabled)
    else:
        lines = {name: "NOT ACTIVE: no plan" for name in FEATURES if name != "attention"}
    if placement.root is not None:  # the video VAE sits on the helper: share its decode
        vae, lines["decode"] = apply_decode_plan(vae, plan, placement.helper)
    if support:
        extra.append(support)
    hooks = hooks_line(model)
    if hooks is not None:
        extra.append(hooks)
    status = compose_status(placement=placement, plan=plan, features=lines,
                            component_notes=notes, extra=extra, server=server)
    return model, clip, vae, audio_vae, latent_upscale_model, plan, status, placement


def _model_inputs(server) -> dict:
    """make_plan's keywords from this server's facts: the loaded DiT's weight format and
    whether the graph samples once."""
    out: dict = {"one_pass": server.passes is not None and server.passes.one_pass}
    dtype = server.model.plan_dtype() if server.model is not None else None
    if dtype is not None:
        out["model_request"] = {"dit_dtype": dtype}
    return out


def _support_line(server) -> str | None:
    """Whether this ComfyUI has H3's nodes (and the graph's upscale), or None outside it."""
    from ..comfy_seam.core_nodes import node_classes

    classes = node_classes()
    return comfyui_support_line(classes, server.passes) if classes is not None else None


class H3MultiGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPU",
            display_name="H3 Multi-GPU",
            category=CATEGORY,
            description="Drop-in: places the H3 DiT on the root GPU and the text encoder, VAEs "
                        "and latent upscaler on the helper GPU, applies the plan's Dual-Sage, "
                        "chunking and prefetch, and reports what each GPU does.",
            inputs=[*_component_inputs(), *size_inputs()],
            outputs=_outputs(),
            # the graph, to say in the status how many passes it samples (never edited)
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, pass2_width=None, pass2_height=None, pass1_width=None,
                        pass1_height=None, seconds=None, devices=None, lora_rank=None):
        return check_sizes(pass2_width, pass2_height, pass1_width, pass1_height, seconds,
                           devices, lora_rank)

    @classmethod
    def execute(cls, model, clip, vae, audio_vae, pass2_width, pass2_height, pass1_width,
                pass1_height, seconds, devices, lora_rank, latent_upscale_model=None,
                plan=None, **advanced) -> io.NodeOutput:
        sizes = dict(pass2_width=pass2_width, pass2_height=pass2_height,
                     pass1_width=pass1_width, pass1_height=pass1_height, seconds=seconds,
                     devices=devices, lora_rank=lora_rank)
        disabled = tuple(f for f in ("dual_sage", "chunking", "prefetch")
                         if advanced.get(f) == "off")
        parallel = advanced.get("parallel", "auto")
        if plan is None:
            sizes["parallel"] = parallel
        disabled += {"off": ("dual_sage", "sequence"), "heads": ("sequence",)}.get(parallel, ())
        *outputs, status, _ = run_dropin(
            model, clip, vae, audio_vae, latent_upscale_model, plan, sizes,
            root_gpu=advanced.get("root_gpu", "auto"),
            helper_gpu=advanced.get("helper_gpu", "auto"), disabled=disabled,
            prompt=getattr(cls.hidden, "prompt", None),
            node_id=getattr(cls.hidden, "unique_id", None))
        return io.NodeOutput(*outputs, status, ui=preview_text(status))


class H3MultiGPUAdvanced(H3MultiGPU):
    @classmethod
    def define_schema(cls):
        schema = super().define_schema()
        schema.node_id = "H3MultiGPUAdvanced"
        schema.display_name = "H3 Multi-GPU (Advanced)"
        schema.inputs = [
            *schema.inputs,
            io.String.Input("root_gpu", default="auto",
                            tooltip="Override the plan's DiT GPU: 'auto' or gpu:N."),
            io.String.Input("helper_gpu", default="auto",
                            tooltip="Override the plan's helper GPU: 'auto' or gpu:N."),
            *(io.Combo.Input(name, options=["plan", "off"], default="plan",
                             tooltip=f"'off' leaves {name} out whatever the plan says.")
              for name in ("dual_sage", "chunking", "prefetch")),
            parallel_input(),
        ]
        return schema

    @classmethod
    def validate_inputs(cls, pass2_width=None, pass2_height=None, pass1_width=None,
                        pass1_height=None, seconds=None, devices=None, lora_rank=None,
                        root_gpu=None, helper_gpu=None):
        for name, text in (("root_gpu", root_gpu), ("helper_gpu", helper_gpu)):
            if text is None:
                continue
            try:
                parsed = parse_device(text)
            except ValueError as exc:
                return f"{name}: {exc}"
            if parsed == "cpu":
                return f"{name}: the H3 job needs a GPU here; use 'auto' or gpu:N"
        return check_sizes(pass2_width, pass2_height, pass1_width, pass1_height, seconds,
                           devices, lora_rank)


NODES = [H3MultiGPU, H3MultiGPUAdvanced]

__all__ = ["H3MultiGPU", "H3MultiGPUAdvanced", "NODES", "Placement", "run_dropin"]
