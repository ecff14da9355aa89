"""Check an API graph against the server's /object_info and H3's geometry before submitting.

ComfyUI validates too, but only after the POST, one failing output at a time, and it knows
nothing of H3's canvas and frame grid: a 1296x720 canvas or a 250-frame clip would start
loading 20 GB of weights and fail minutes later. Every problem is collected and reported at
once, each naming the node and the fix.

The checks are the server's own (`server_rules.py`: how ComfyUI converts, range-checks and
option-checks each input, which nodes it checks at all), so `submit --check` refuses what the
server refuses and accepts what it accepts. Two checks are stricter on purpose, because the
server would queue the graph and fail later: H3's canvas and frame grid, and a DynamicCombo
key the node does not offer. What the server accepts but changes or ignores (an input it does
not declare, "24" for an INT) comes back as a note, which `submit` prints as a warning.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from ..common.checks import check_seconds, check_two_pass
from ..common.geometry import validate_canvas, validate_frames
from . import editor
from . import server_rules as rules
from .errors import Problem, WorkflowError, shown
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
    offered = ", ".join(repr(o) for o in options[:8])
    more = f" (+{len(options) - 8} more)" if len(options) > 8 else ""
    return f"the server offers {offered}{more}" if options else "the server offers none"


def _check_input(where: str, name: str, value: Any, kind: Any, opts: dict,
                 self_checked: bool) -> tuple[list[Problem], list[Problem]]:
    """(problems, notes) of one literal input, by the server's rules (server_rules.py)."""
    refusal, note = rules.check_literal(kind, opts, value, self_checked)
    if refusal is None:
        return [], [Problem(where, f"input '{name}' {note}")] if note else []
    options = combo_options(kind, opts)
    if options is not None and "not offered" in refusal:
        hint = _offered(options, value)
        if str(value).lower().endswith(MODEL_SUFFIXES):
            hint += " (a model file must be in the server's models folder)"
        refusal += f"; {hint}"
    return [Problem(where, f"input '{name}' {refusal}")], []


def _check_link(prompt: ApiPrompt, object_info: dict, where: str, name: str, link: list,
                kind: Any) -> list[Problem]:
    if len(link) != 2 or not isinstance(link[1], int):
        return [Problem(where, f"input '{name}' = {shown(link)} is not a link "
                        f"[\"node_id\", slot]")]
    source_id = str(link[0])
    source = prompt.get(source_id)
    if source is None:
        return [Problem(where, f"input '{name}' links to node #{source_id}, which is not in the "
                        f"graph; reconnect it")]
    outputs = (object_info.get(source.get("class_type")) or {}).get("output")
    if outputs is None:
        return []
    if not 0 <= link[1] < len(outputs):
        return [Problem(where, f"input '{name}' links to output {shown(link[1])} of "
                        f"{describe_node(prompt, source_id)}, which has {len(outputs)}")]
    if not rules.link_types_meet(outputs[link[1]], kind):
        wanted = "COMBO" if isinstance(kind, list) else kind
        return [Problem(where, f"input '{name}' takes {wanted} but is linked to output "
                        f"{link[1]} ({outputs[link[1]]}) of {describe_node(prompt, source_id)}; "
                        f"connect an output of type {wanted}")]
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


@dataclass
class Review:
    """What the client found: `problems` the server would refuse (or that fail when the graph
    runs: H3's canvas and frame grid, a DynamicCombo key), and `notes` on what it accepts but
    the user may not expect (an input it ignores, a value it converts, a node it skips)."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Problem] = field(default_factory=list)


def review_prompt(prompt: ApiPrompt, object_info: dict) -> Review:
    """Check `prompt` against `object_info` and H3 geometry the way the server checks it."""
    review = Review()
    has_output = False
    checked = rules.reachable_from_outputs(prompt, object_info)
    for node_id, node in prompt.items():
        where = describe_node(prompt, node_id)
        class_type = node.get("class_type")
        info = object_info.get(class_type)
        if info is None:
            close = difflib.get_close_matches(str(class_type), list(object_info), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            review.problems.append(Problem(where, f"class '{class_type}' is not installed on "
                                           f"the server{hint}; "
                                           f"{missing_class_fix(str(class_type))}"))
            continue
        has_output = has_output or bool(info.get("output_node"))
        problems, notes = _check_node(prompt, object_info, where, str(class_type), info,
                                      node.get("inputs") or {})
        review.notes += notes
        if node_id in checked:
            review.problems += problems
        else:  # the server neither validates nor runs it
            review.notes += [Problem(p.where, f"{p.message} (it feeds no output node, so the "
                                     f"server does not check or run it)") for p in problems]
    if prompt and not has_output and not any(p.message.startswith("class ")
                                             for p in review.problems):
        review.problems.append(Problem("graph", "no output node (SaveVideo, SaveImage, ...): "
                                       "the server would run nothing; add one"))
    return review


def _check_node(prompt: ApiPrompt, object_info: dict, where: str, class_type: str, info: dict,
                inputs: dict) -> tuple[list[Problem], list[Problem]]:
    problems: list[Problem] = []
    notes: list[Problem] = []
    declared = expanded_inputs(info, inputs)
    self_checked = rules.PACK_SELF_CHECKED.get(class_type, ())
    for name, (_kind, _opts, required) in declared.items():
        if required and name not in inputs:
            problems.append(Problem(where, f"required input '{name}' is missing; connect or set "
                                    f"it (a workflow saved by a newer ComfyUI may name it "
                                    f"differently: update the server)"))
    ignored = []
    for name, value in inputs.items():
        spec = declared.get(name)
        if spec is None:
            if name not in (info.get("input") or {}).get("hidden", {}):
                ignored.append(name)
            continue
        if isinstance(value, list):
            problems += _check_link(prompt, object_info, where, name, value, spec[0])
        else:
            found, noted = _check_input(where, name, value, spec[0], spec[1],
                                        name in self_checked)
            problems += found
            notes += noted
    if ignored:
        known = sorted(n for n in declared if "." not in n)
        them = "it" if len(ignored) == 1 else "them"
        notes.append(Problem(where, f"{class_type} on this server has no input "
                             f"{', '.join(repr(n) for n in ignored)}; the server ignores {them} "
                             f"(its inputs: {', '.join(known) or 'none'}). A workflow made for "
                             f"another ComfyUI release may carry inputs this one lacks"))
    if is_h3_class(class_type):
        problems += _check_geometry(where, inputs)
    return problems, notes


def check_prompt(prompt: ApiPrompt, object_info: dict) -> list[Problem]:
    """Every problem of `prompt` against `object_info` and H3 geometry (empty when fine)."""
    return review_prompt(prompt, object_info).problems


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


def _literal_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_geometry(where: str, inputs: dict) -> list[Problem]:
    """H3's canvas and frame grid, and the pack's own checks of what its nodes validate
    themselves (common/checks.py, the functions their validate_inputs run): both passes'
    canvases and the seconds. Linked inputs are checked by the node when it runs."""
    problems = []
    width, height = _literal_int(inputs.get("width")), _literal_int(inputs.get("height"))
    if width is not None and height is not None:
        try:
            validate_canvas(width, height)
        except ValueError as exc:
            problems.append(Problem(where, str(exc)))
    for name in FRAME_INPUTS:
        frames = _literal_int(inputs.get(name))
        if frames is not None:
            try:
                validate_frames(frames)
            except ValueError as exc:
                problems.append(Problem(where, f"input '{name}': {exc}"))
    sizes = [_literal_int(inputs.get(f"{p}_{side}")) for p in ("pass1", "pass2")
             for side in ("width", "height")]
    if None not in sizes:
        message = check_two_pass(*sizes)
        if message:
            problems.append(Problem(where, message))
    seconds = inputs.get("seconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        message = check_seconds(seconds)
        if message:
            problems.append(Problem(where, f"input 'seconds': {message}"))
    return problems


def validate_prompt(prompt: ApiPrompt, object_info: dict) -> None:
    """Raise WorkflowError listing every problem of `prompt`, or return when it is fine."""
    problems = check_prompt(prompt, object_info)
    if problems:
        raise WorkflowError(problems, "the graph does not match the server")
