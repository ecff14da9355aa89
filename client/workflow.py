"""Workflow files: tell API format from UI format, and convert UI format to API format.

API format is `{node_id: {"class_type", "inputs", "_meta": {"title"}}}` with links written as
`["node_id", output_index]`. UI format (what the ComfyUI editor saves) has `nodes` and `links`
lists and stores widget values positionally in `widgets_values`; mapping them to input names
needs the server's `/object_info`, whose `input_order` gives the order in which the editor
creates widgets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import Problem, WorkflowError

ApiPrompt = dict[str, dict[str, Any]]

# Nodes that exist only in the editor: they never reach the server.
UI_ONLY_TYPES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
MODE_MUTED = 2  # "never": the node and everything only it feeds are left out
MODE_BYPASSED = 4  # the node is skipped, its inputs are passed through to matching outputs
# The editor adds a "control after generate" widget after seed-like values; its value is one of
# these and belongs to no input.
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})


def load_workflow(source: str | Path | dict) -> dict:
    """Read a workflow from a path or take a dict; raise WorkflowError naming the file."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkflowError([Problem(str(path), f"cannot read the file: {exc.strerror}")]) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkflowError(
            [Problem(str(path), f"not valid JSON (line {exc.lineno}, column {exc.colno})")]
        ) from exc
    if not isinstance(data, dict):
        raise WorkflowError([Problem(str(path), "expected a JSON object (a ComfyUI workflow)")])
    return data


def is_ui_format(workflow: dict) -> bool:
    return isinstance(workflow.get("nodes"), list) and "links" in workflow


def is_api_format(workflow: dict) -> bool:
    return bool(workflow) and all(
        isinstance(node, dict) and "class_type" in node for node in workflow.values()
    )


def node_title(prompt: ApiPrompt, node_id: str) -> str:
    node = prompt.get(node_id, {})
    meta = node.get("_meta") or {}
    return str(meta.get("title") or node.get("class_type") or node_id)


def describe_node(prompt: ApiPrompt, node_id: str) -> str:
    """`node #12 'PASS2 Size' (EmptyMiniMaxH3LatentAV)`: how every message names a node."""
    node = prompt.get(node_id, {})
    class_type = node.get("class_type", "?")
    title = node_title(prompt, node_id)
    if title == class_type:
        return f"node #{node_id} ({class_type})"
    return f"node #{node_id} '{title}' ({class_type})"


def input_spec(info: dict, name: str) -> tuple[Any, dict] | None:
    """The `(type, options)` of input `name` in an /object_info entry, or None."""
    for section in ("required", "optional"):
        spec = (info.get("input") or {}).get(section, {}).get(name)
        if spec is not None:
            kind = spec[0] if spec else None
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            return kind, opts
    return None


def combo_options(kind: Any, opts: dict) -> list | None:
    """Offered values of a combo input: old style `[[...], {}]`, new `["COMBO", {"options"}]`."""
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return list(opts.get("options") or [])
    return None


def is_widget(kind: Any, opts: dict) -> bool:
    if opts.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def widget_names(info: dict) -> list[str]:
    """Input names that are widgets, in the order the editor stores their values."""
    declared = info.get("input") or {}
    order = info.get("input_order") or {
        section: list(declared.get(section, {})) for section in ("required", "optional")
    }
    names = []
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = input_spec(info, name)
            if spec is not None and is_widget(*spec):
                names.append(name)
    return names


def _has_control_widget(name: str, kind: Any, opts: dict) -> bool:
    return bool(opts.get("control_after_generate")) or (
        kind == "INT" and name in ("seed", "noise_seed")
    )


def _links_by_id(ui: dict) -> dict[int, tuple[int, int, str]]:
    """link id -> (origin node id, origin slot, type); both serialisations of the editor."""
    links = {}
    for link in ui.get("links") or []:
        if isinstance(link, dict):
            links[link["id"]] = (link["origin_id"], link["origin_slot"], link.get("type", "*"))
        else:
            link_id, origin, slot, _target, _target_slot, kind = link[:6]
            links[link_id] = (origin, slot, kind)
    return links


def ui_to_api(ui: dict, object_info: dict) -> ApiPrompt:
    """Convert an editor workflow to API format; raise WorkflowError listing every problem.

    Notes, Markdown notes and Reroutes are dropped (reroutes resolved to their source); muted
    nodes are dropped with the links they feed; bypassed nodes pass an input of the same type
    through. Subgraphs and legacy group nodes are refused: export API format from the editor.
    """
    nodes = {node["id"]: node for node in ui.get("nodes", [])}
    links = _links_by_id(ui)
    subgraph_ids = {sg.get("id") for sg in (ui.get("definitions") or {}).get("subgraphs") or []}
    problems: list[Problem] = []

    def where(node: dict) -> str:
        title = node.get("title") or node.get("type")
        return f"node #{node['id']} '{title}' ({node.get('type')})"

    def resolve(link_id: int, depth: int = 0) -> tuple[str, int] | str | None:
        """Follow a link to a real output: ("id", slot), "widget" (a PrimitiveNode) or None."""
        if link_id not in links or depth > len(nodes):
            return None
        origin_id, slot, kind = links[link_id]
        origin = nodes.get(origin_id)
        if origin is None:
            return None
        if origin.get("type") == "PrimitiveNode":
            return "widget"  # the target keeps the value in its own widgets_values
        if origin.get("type") == "Reroute" or origin.get("mode") == MODE_BYPASSED:
            upstream = _pass_through_link(origin, slot, kind)
            return None if upstream is None else resolve(upstream, depth + 1)
        if origin.get("mode") == MODE_MUTED or origin.get("type") in UI_ONLY_TYPES:
            return None
        return str(origin_id), slot

    prompt: ApiPrompt = {}
    for node in nodes.values():
        kind = node.get("type")
        if kind in UI_ONLY_TYPES or node.get("mode") in (MODE_MUTED, MODE_BYPASSED):
            continue
        if kind in subgraph_ids or str(kind).startswith(("workflow>", "workflow/")):
            problems.append(Problem(where(node), "subgraphs and group nodes are not supported; "
                                    "unpack it in the editor (right click > Unpack Subgraph) or "
                                    "export the workflow in API format"))
            continue
        info = object_info.get(kind)
        inputs: dict[str, Any] = {}
        if info is None:
            problems.append(Problem(where(node), f"class '{kind}' is not installed on the "
                                    "server; install the node pack that provides it"))
        else:
            inputs.update(_widget_inputs(node, info))
        for slot in node.get("inputs") or []:
            if slot.get("link") is None:
                continue
            target = resolve(slot["link"])
            if target == "widget":
                continue
            if target is None:
                # Source muted or missing: the input stays unset (or keeps its widget value)
                # and validation reports it if it was required.
                continue
            inputs[slot["name"]] = [target[0], target[1]]
        title = node.get("title") or (info or {}).get("display_name") or kind
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs, "_meta": {"title": title}}
    if problems:
        raise WorkflowError(problems, "the UI workflow cannot be converted to API format")
    return prompt


def _pass_through_link(node: dict, out_slot: int, kind: str) -> int | None:
    """The input link a Reroute or a bypassed node forwards to output `out_slot`."""
    inputs = node.get("inputs") or []
    if node.get("type") == "Reroute":
        return inputs[0].get("link") if inputs else None
    # Bypass: the editor forwards the input whose type matches the output, preferring the
    # input at the same position.
    candidates = [i for i, slot in enumerate(inputs) if slot.get("type") in (kind, "*")]
    if out_slot in candidates and inputs[out_slot].get("link") is not None:
        return inputs[out_slot]["link"]
    for index in candidates:
        if inputs[index].get("link") is not None:
            return inputs[index]["link"]
    return None


def _widget_inputs(node: dict, info: dict) -> dict:
    values = node.get("widgets_values")
    if isinstance(values, dict):  # some packs save widgets by name
        return {name: values[name] for name in widget_names(info) if name in values}
    values = list(values or [])
    inputs = {}
    position = 0
    for name in widget_names(info):
        if position >= len(values):
            break
        inputs[name] = values[position]
        position += 1
        kind, opts = input_spec(info, name) or (None, {})
        if (
            _has_control_widget(name, kind, opts)
            and position < len(values)
            and values[position] in CONTROL_VALUES
        ):
            position += 1
    return inputs
