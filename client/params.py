"""Patch an API graph by node title: `--seed 7` sets the input of the node titled "Seed".

Titles (`_meta.title`) are what a workflow author controls and what survives re-exporting, so
the bundled workflows name the nodes a user may change. The mapping parameter -> (title, input)
is data: `DEFAULT_TARGETS` matches the bundled workflows (workflows/api/*.json), with
alternative titles for hand-made graphs, and `parse_target()` reads the CLI's
`--map seed="My Seed:noise_seed"` overrides for other graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common.geometry import snap_frames, validate_canvas
from .errors import Problem, WorkflowError, shown
from .validate import is_h3_class
from .workflow import ApiPrompt, describe_node, node_title


@dataclass(frozen=True)
class Target:
    """Where a parameter goes: the nodes with the first of `titles` the graph has, and the
    first of `inputs` those nodes have.

    `bypass_input`: for an on/off parameter whose node has no boolean input (the turbo LoRA
    loader), False removes the node and wires its consumers to this input's source instead.
    """

    titles: tuple[str, ...]
    inputs: tuple[str, ...]
    bypass_input: str | None = None

    def __post_init__(self) -> None:
        # Target("Seed", "value") means one title and one input, not tuples of characters.
        for name in ("titles", "inputs"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))

    @property
    def title(self) -> str:
        return self.titles[0]


DEFAULT_TARGETS: dict[str, Target] = {
    "prompt": Target(("Prompt",), ("value", "text", "prompt", "string")),
    "seconds": Target(("Seconds",), ("seconds", "value", "duration")),
    "seed": Target(("Seed",), ("value", "noise_seed", "seed")),
    "steps": Target(("Steps", "PASS1 Steps"), ("value", "steps")),
    "pass1_steps": Target(("PASS1 Steps",), ("value", "steps")),
    "pass2_steps": Target(("PASS2 Steps",), ("value", "steps")),
    "turbo": Target(("Turbo LoRA", "Turbo"), ("enabled", "value", "boolean"),
                    bypass_input="model"),
    "pass1_width": Target(("PASS1 Width", "PASS1 Size"), ("value", "width")),
    "pass1_height": Target(("PASS1 Height", "PASS1 Size"), ("value", "height")),
    "pass2_width": Target(("PASS2 Width", "PASS2 Size"), ("value", "width")),
    "pass2_height": Target(("PASS2 Height", "PASS2 Size"), ("value", "height")),
}
PASSES = ("pass1", "pass2")


def parse_size(text: str) -> tuple[int, int]:
    """'864x480' -> (864, 480), checked against H3's canvas rule."""
    parts = [p.strip() for p in text.lower().replace("*", "x").split("x")]
    # ASCII digits only: isdigit() alone passes '²', which int() refuses with a raw message
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        raise ValueError(f"size {text!r:.60} is not WIDTHxHEIGHT; use e.g. 864x480 or 1312x736")
    return validate_canvas(int(parts[0]), int(parts[1]))


def parse_target(text: str) -> tuple[str, Target]:
    """`seed=My Seed:noise_seed` -> ("seed", Target(("My Seed",), ("noise_seed",)))."""
    name, sep, rest = text.partition("=")
    title, sep2, input_name = rest.rpartition(":")
    if not sep or not sep2 or not name.strip() or not title or not input_name:
        raise ValueError(
            f"--map {text!r} is not NAME=TITLE:INPUT; use e.g. seed='Seed:value' "
            f"(names: {', '.join(DEFAULT_TARGETS)})"
        )
    return name.strip().replace("-", "_"), Target((title,), (input_name,))


def find_nodes(prompt: ApiPrompt, target: Target) -> list[str]:
    """Ids of the nodes carrying the first of the target's titles that the graph has."""
    for title in target.titles:
        found = [i for i in prompt if node_title(prompt, i) == title]
        if found:
            return found
    return []


def read_value(prompt: ApiPrompt, target: Target) -> tuple[str, Any] | None:
    """(node id, value) of a target's first node when it holds a literal, else None."""
    for node_id in find_nodes(prompt, target):
        inputs = prompt[node_id].get("inputs") or {}
        name = next((n for n in target.inputs if n in inputs), None)
        if name is not None and not isinstance(inputs[name], list):
            return node_id, inputs[name]
    return None


def expand_params(params: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """User-level params -> per-input values; sizes split into width/height and checked.

    Accepts `pass1_size`/`pass2_size` as "WxH" or (w, h); `seconds` must give a valid clip.
    """
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, value in params.items():
        if value is None:
            continue
        if name.endswith("_size"):
            stem = name[: -len("_size")]
            try:
                width, height = parse_size(value) if isinstance(value, str) else value
                validate_canvas(width, height)
            except (TypeError, ValueError) as exc:
                problems.append(Problem(f"--{stem.replace('_', '-')}-size", str(exc)))
                continue
            values[f"{stem}_width"], values[f"{stem}_height"] = width, height
        elif name == "seconds":
            try:
                snap_frames(value)
            except ValueError as exc:
                problems.append(Problem("--seconds", str(exc)))
                continue
            values[name] = value
        else:
            values[name] = value
    return values, problems


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2


def _bypass(prompt: ApiPrompt, node_id: str, input_name: str) -> None:
    """Remove `node_id`, wiring whoever read its output 0 to its `input_name` source."""
    source = prompt[node_id]["inputs"][input_name]
    del prompt[node_id]
    for node in prompt.values():
        for name, value in node["inputs"].items():
            if _is_link(value) and str(value[0]) == node_id and value[1] == 0:
                node["inputs"][name] = list(source)


def apply_params(
    prompt: ApiPrompt, params: dict[str, Any], targets: dict[str, Target] | None = None
) -> tuple[ApiPrompt, list[str]]:
    """Return a patched copy of `prompt` and a line per change; raise listing every problem.

    A title that matches no node is an error naming the titles the graph has; a title shared by
    several nodes patches all of them (each reported in the change lines).
    """
    targets = {**DEFAULT_TARGETS, **(targets or {})}
    values, problems = expand_params(params)
    patched = {node_id: {**node, "inputs": dict(node.get("inputs", {}))}
               for node_id, node in prompt.items()}
    titles = sorted({node_title(prompt, node_id) for node_id in prompt})
    changes: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        target = targets.get(name)
        if target is None:
            problems.append(Problem(flag, f"no target for parameter '{name}'; add one with "
                                    f"--map {name}='TITLE:INPUT'"))
            continue
        node_ids = find_nodes(prompt, target)
        if not node_ids:
            wanted = " or ".join(f"'{t}'" for t in target.titles)
            problems.append(Problem(flag, f"no node is titled {wanted}; titles in this "
                                    f"graph: {', '.join(titles)}. Rename the node or pass "
                                    f"--map {name}='TITLE:INPUT'"))
            continue
        for node_id in node_ids:
            where = f"{flag} -> {describe_node(prompt, node_id)}"
            inputs = patched[node_id]["inputs"]
            input_name = next((n for n in target.inputs if n in inputs), None)
            if input_name is None and target.bypass_input in inputs and isinstance(value, bool):
                if not value and not _is_link(inputs[target.bypass_input]):
                    problems.append(Problem(where, f"cannot be bypassed: its input "
                                            f"'{target.bypass_input}' is not linked to a node "
                                            f"whose output could take its place"))
                elif value:
                    changes.append(f"{describe_node(prompt, node_id)} kept")
                else:
                    _bypass(patched, node_id, target.bypass_input)
                    changes.append(f"{describe_node(prompt, node_id)} bypassed (the workflow's "
                                   f"step counts stay; raise them with --pass1-steps)")
                continue
            if input_name is None:
                problems.append(Problem(where, f"has none of the inputs "
                                        f"{', '.join(target.inputs)} (it has: "
                                        f"{', '.join(sorted(inputs)) or 'none'}); pass "
                                        f"--map {name}='TITLE:INPUT'"))
                continue
            if isinstance(inputs[input_name], list):
                source = inputs[input_name][0]
                problems.append(Problem(where, f"input '{input_name}' is linked to "
                                        f"{describe_node(prompt, str(source))}; set the value "
                                        f"on that node (title it and use --map)"))
                continue
            inputs[input_name] = value
            changes.append(f"{describe_node(prompt, node_id)}.{input_name} = {shown(value)}")
    if problems:
        raise WorkflowError(problems, "the parameters cannot be applied")
    return patched, changes


def check_pass_geometry(prompt: ApiPrompt, targets: dict[str, Target] | None = None
                        ) -> list[Problem]:
    """Canvas of each pass and the duration, read through the same titles the flags patch.

    The bundled graphs keep sizes in primitive nodes (PASS1 Width, PASS1 Height, ...) far from
    the nodes that use them, so they are checked here by title.
    """
    targets = {**DEFAULT_TARGETS, **(targets or {})}
    problems: list[Problem] = []
    for stem in PASSES:
        width = read_value(prompt, targets[f"{stem}_width"])
        height = read_value(prompt, targets[f"{stem}_height"])
        if width is None or height is None:
            continue
        if width[0] == height[0] and is_h3_class(prompt[width[0]].get("class_type", "")):
            continue  # an H3 node's own width/height: check_prompt reports it
        try:
            validate_canvas(width[1], height[1])
        except ValueError as exc:
            where = describe_node(prompt, width[0])
            if height[0] != width[0]:
                where += f" / {describe_node(prompt, height[0])}"
            problems.append(Problem(where, f"{exc} (or pass --{stem}-size)"))
    seconds = read_value(prompt, targets["seconds"])
    if seconds is not None:
        try:
            snap_frames(seconds[1])
        except ValueError as exc:
            problems.append(Problem(describe_node(prompt, seconds[0]), str(exc)))
    return problems
