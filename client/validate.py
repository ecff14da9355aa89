"""Check an API graph against the server's /object_info and H3's geometry before submitting.

ComfyUI validates too, but only after the POST, one failing output at a time, and it knows
nothing of H3's canvas and frame grid: a 1296x720 canvas or a 250-frame clip would start
loading 20 GB of weights and fail minutes later. Every problem is collected and reported at
once, each naming the node and the fix.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..geometry import validate_canvas, validate_frames
from . import editor
from .errors import Problem, WorkflowError
from .workflow import ApiPrompt, combo_options, describe_node

FRAME_INPUTS = ("length", "frames", "num_frames", "frame_count")
MODEL_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf")


def is_h3_class(class_type: str) -> bool:
    """Core MiniMax H3 nodes and this pack's nodes: their width/height/length are H3's."""
    return "MiniMaxH3" in class_type or class_type.startswith("H3")


def _offered(options: list, value: Any) -> str:
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=3)
    if close:
        return f"did you mean {', '.join(repr(c) for c in close)}?"
    shown = ", ".join(repr(o) for o in options[:8])
    more = f" (+{len(options) - 8} more)" if len(options) > 8 else ""
    return f"the server offers {shown}{more}" if options else "the server offers none"


def _check_input(where: str, name: str, value: Any, kind: Any, opts: dict) -> list[Problem]:
    options = combo_options(kind, opts)
    if options is not None:
        if value not in options:
            hint = _offered(options, value)
            if str(value).lower().endswith(MODEL_SUFFIXES):
                hint += " (a model file must be in the server's models folder)"
            return [Problem(where, f"input '{name}' = {value!r} is not offered by the server; "
                            f"{hint}")]
        return []
    if kind in ("INT", "FLOAT") and isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = opts.get("min"), opts.get("max")
        if low is not None and value < low or high is not None and value > high:
            return [Problem(where, f"input '{name}' = {value} is outside [{low}, {high}]")]
        if kind == "INT" and not float(value).is_integer():
            return [Problem(where, f"input '{name}' = {value} must be an integer")]
    if kind == "BOOLEAN" and not isinstance(value, bool):
        return [Problem(where, f"input '{name}' = {value!r} must be true or false")]
    return []


def _check_link(prompt: ApiPrompt, object_info: dict, where: str, name: str, link: list
                ) -> list[Problem]:
    if len(link) != 2 or not isinstance(link[1], int):
        return [Problem(where, f"input '{name}' = {link!r} is not a link [\"node_id\", slot]")]
    source_id = str(link[0])
    source = prompt.get(source_id)
    if source is None:
        return [Problem(where, f"input '{name}' links to node #{source_id}, which is not in the "
                        f"graph; reconnect it")]
    outputs = (object_info.get(source.get("class_type")) or {}).get("output")
    if outputs is not None and not 0 <= link[1] < len(outputs):
        return [Problem(where, f"input '{name}' links to output {link[1]} of "
                        f"{describe_node(prompt, source_id)}, which has {len(outputs)}")]
    return []


def expanded_inputs(info: dict, inputs: dict) -> dict[str, tuple[Any, dict, bool]]:
    """name -> (type, options, required) of every input a node has given its live inputs, as
    the server expands them: a DynamicCombo adds its chosen option's inputs as `combo.input`,
    an Autogrow input stands for its slots `name.prefixN` (the first `min` required)."""
    out: dict[str, tuple[Any, dict, bool]] = {}

    def walk(entry: dict, prefix: str) -> None:
        for name, kind, opts, optional in editor.declared_inputs(entry):
            full = prefix + name
            if kind == editor.AUTOGROW:
                template = opts.get("template") or {}
                slot_kind = editor.autogrow_type(opts)
                slot_opts = next(iter(((template.get("input") or {}).get("required") or {})
                                      .values()), [None, {}])
                slot_opts = slot_opts[1] if len(slot_opts) > 1 else {}
                minimum = int(template.get("min", 0))
                for index, slot in enumerate(editor.autogrow_names(full, opts)):
                    out[slot] = (slot_kind, slot_opts, index < minimum and not optional)
                continue
            out[full] = (kind, opts, not optional)
            if kind == editor.DYNAMIC_COMBO and full in inputs:
                option = editor.dynamic_option_inputs(opts, inputs[full])
                walk({"input": option}, full + ".")

    walk(info, "")
    return out


def check_prompt(prompt: ApiPrompt, object_info: dict) -> list[Problem]:
    """Every problem of `prompt` against `object_info` and H3 geometry (empty when fine)."""
    problems: list[Problem] = []
    has_output = False
    for node_id, node in prompt.items():
        where = describe_node(prompt, node_id)
        class_type = node.get("class_type")
        info = object_info.get(class_type)
        if info is None:
            close = difflib.get_close_matches(str(class_type), list(object_info), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(Problem(where, f"class '{class_type}' is not installed on the "
                                    f"server{hint}; {missing_class_fix(str(class_type))}"))
            continue
        has_output = has_output or bool(info.get("output_node"))
        inputs = node.get("inputs") or {}
        declared = expanded_inputs(info, inputs)
        for name, (_kind, _opts, required) in declared.items():
            if required and name not in inputs:
                problems.append(Problem(where, f"required input '{name}' is missing; connect "
                                        f"or set it (a workflow saved by a newer ComfyUI may "
                                        f"name it differently: update the server)"))
        for name, value in inputs.items():
            spec = declared.get(name)
            if spec is None:
                if name in (info.get("input") or {}).get("hidden", {}):
                    continue
                known = sorted(n for n in declared if "." not in n)
                problems.append(Problem(where, f"input '{name}' does not exist on {class_type} "
                                        f"(inputs: {', '.join(known) or 'none'}); the node "
                                        f"changed upstream: re-export the workflow"))
                continue
            if isinstance(value, list):
                problems += _check_link(prompt, object_info, where, name, value)
            else:
                problems += _check_input(where, name, value, spec[0], spec[1])
        if is_h3_class(str(class_type)):
            problems += _check_geometry(where, inputs)
    if prompt and not has_output and not any(p.message.startswith("class ") for p in problems):
        problems.append(Problem("graph", "no output node (SaveVideo, SaveImage, ...): the "
                                "server would run nothing; add one"))
    return problems


# What a missing class means for the bundled H3 workflows, and what to do about it.
NEEDS_H3 = ("a ComfyUI with the MiniMax H3 nodes (ComfyUI#15224 or newer; update ComfyUI)")
MISSING_FIXES = {
    "MiniMaxH3LatentUpscaleWithModel": "this ComfyUI predates core's learned latent upscale; "
                                       "use this pack's 'H3 Latent Upscale' with 'H3 Load Latent "
                                       "Upscaler' (the bundled workflows do), or update ComfyUI",
}


def missing_class_fix(class_type: str) -> str:
    if class_type in MISSING_FIXES:
        return MISSING_FIXES[class_type]
    if "MiniMaxH3" in class_type:
        return f"this workflow needs {NEEDS_H3}"
    if class_type.startswith("H3MultiGPU"):
        return "install or update this pack (comfyui-h3-multigpu) on the server"
    return "install the node pack that provides it or update ComfyUI"


def _check_geometry(where: str, inputs: dict) -> list[Problem]:
    problems = []
    width, height = inputs.get("width"), inputs.get("height")
    if isinstance(width, int) and isinstance(height, int):
        try:
            validate_canvas(width, height)
        except ValueError as exc:
            problems.append(Problem(where, str(exc)))
    for name in FRAME_INPUTS:
        frames = inputs.get(name)
        if isinstance(frames, int) and not isinstance(frames, bool):
            try:
                validate_frames(frames)
            except ValueError as exc:
                problems.append(Problem(where, f"input '{name}': {exc}"))
    return problems


def validate_prompt(prompt: ApiPrompt, object_info: dict) -> None:
    """Raise WorkflowError listing every problem of `prompt`, or return when it is fine."""
    problems = check_prompt(prompt, object_info)
    if problems:
        raise WorkflowError(problems, "the graph does not match the server")
