"""Workflow files: tell API format from UI format, and convert UI format to API format.

API format is `{node_id: {"class_type", "inputs", "_meta": {"title"}}}` with links written as
`["node_id", output_index]`. UI format (what the ComfyUI editor saves) has `nodes` and `links`
lists and stores widget values positionally in `widgets_values`; mapping them to input names
needs the server's `/object_info` and the editor's widget order (`editor.py`).

`ui_to_api` converts the way the editor's own `graphToPrompt()` (frontend 1.58) does, so the
result is the graph the editor would queue: subgraphs are expanded (inner nodes get ids
`"<subgraph node id>:<inner id>"`, promoted widgets give their values to the inner inputs,
links through the subgraph's inputs and outputs reach the real nodes), DynamicCombo widgets
become `format` plus `format.codec`, Autogrow slots keep their `ref_images.ref_image_0` names,
notes and reroutes disappear, muted nodes are dropped, bypassed nodes pass their inputs on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import editor
from .errors import Problem, WorkflowError

ApiPrompt = dict[str, dict[str, Any]]

# Nodes that exist only in the editor: they never reach the server.
UI_ONLY_TYPES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
MODE_MUTED = 2  # "never": the node and everything only it feeds are left out
MODE_BYPASSED = 4  # the node is skipped, its inputs are passed through to matching outputs
SUBGRAPH_INPUT_NODE = -10  # link origin inside a subgraph: one of the subgraph's inputs
SUBGRAPH_OUTPUT_NODE = -20  # link target inside a subgraph: one of its outputs


MAX_WORKFLOW_BYTES = 256 << 20  # a big editor workflow is a few MB; a bound, not a guess
FOREIGN_FILES = ((b"\x89PNG", "a PNG image: ComfyUI keeps the workflow inside the images it "
                              "saves; drop it on the editor and export the workflow as JSON"),
                 (b"PK\x03\x04", "a ZIP archive: unpack the workflow JSON from it"),
                 (b"\x00\x00\x00", "binary data (a video?), not a workflow"))


def load_workflow(source: str | Path | dict) -> dict:
    """Read a workflow from a path or take a dict; raise WorkflowError naming the file.

    A UTF-8 byte order mark (Windows editors write one) is accepted; a file that is empty, not
    UTF-8 text, not JSON, nested without end, or JSON that is not an object is refused with
    what it is and what to do.
    """
    if isinstance(source, dict):
        return source
    path = Path(source)
    shown = str(path)

    def refuse(message: str) -> WorkflowError:
        return WorkflowError([], f"the workflow file {message}", shown)

    try:
        if path.is_dir():
            raise refuse("is a folder; give the path of a workflow .json file")
        if path.stat().st_size > MAX_WORKFLOW_BYTES:
            raise refuse(f"is {path.stat().st_size:,} bytes, more than any workflow; is it a "
                         f"model or a video?")
        raw = path.read_bytes()
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    for magic, what in FOREIGN_FILES:
        if raw.startswith(magic):
            raise refuse(f"is {what}")
    # UTF-8 with or without a byte order mark; UTF-16 with one (what PowerShell's Out-File
    # and Notepad's "Unicode" write)
    encoding = "utf-16" if raw.startswith((b"\xff\xfe", b"\xfe\xff")) else "utf-8-sig"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        name = "UTF-16" if encoding == "utf-16" else "UTF-8"
        raise refuse(f"is not {name} text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                     f"is it a workflow? Save it as UTF-8 JSON (ComfyUI's editor does)"
                     ) from None
    if not text.strip():
        raise refuse("is empty; save the workflow from the editor again")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise refuse(f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                     f"was it cut short or edited by hand? Save it from the editor again"
                     ) from None
    except RecursionError:
        raise refuse("is nested deeper than any workflow (lists or objects inside each other "
                     "without end)") from None
    except ValueError:  # the one other refusal of json.loads: CPython's int digit limit
        raise refuse("holds a number of more than 4300 digits; no workflow needs one that long"
                     ) from None
    if not isinstance(data, dict):
        raise refuse(f"holds a JSON {_json_kind(data)}, not an object; a ComfyUI workflow is "
                     f"an object (editor format: nodes and links; API format: node ids)")
    return data


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def is_ui_format(workflow: dict) -> bool:
    return isinstance(workflow.get("nodes"), list) and "links" in workflow


def is_api_format(workflow: dict) -> bool:
    return bool(workflow) and all(
        isinstance(node, dict) and "class_type" in node for node in workflow.values()
    )


def node_title(prompt: ApiPrompt, node_id: str) -> str:
    node = prompt.get(node_id, {})
    meta = node.get("_meta")
    title = meta.get("title") if isinstance(meta, dict) else None  # ComfyUI ignores _meta
    return str(title or node.get("class_type") or node_id)


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
    """Offered values of a combo input: old style `[[...], {}]`, new `["COMBO", {"options"}]`,
    or the keys of a DynamicCombo."""
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return list(opts.get("options") or [])
    if kind == editor.DYNAMIC_COMBO:
        return editor.combo_keys(opts)
    return None


def widget_names(info: dict) -> list[str]:
    """Input names that are widgets, in the order the editor stores their values."""
    return [w.input for w in editor.widgets(info) if w.input]


def api_sort_key(node_id: str) -> tuple:
    """Node ids in the order the converter and the bundled API files list them:
    "12" < "12:3" < "12:10" < "13" (ids that are not numbers go last, by name)."""
    parts = str(node_id).split(":")
    if all(part.isascii() and part.isdigit() for part in parts):  # not '²': int() refuses it
        return (0, *(int(part) for part in parts))
    return (1, str(node_id))


def _links_by_id(graph: dict) -> dict[int, tuple[Any, int, Any, int, str]]:
    """link id -> (origin id, origin slot, target id, target slot, type); both forms."""
    links = {}
    for link in graph.get("links") or []:
        if isinstance(link, dict):
            links[link["id"]] = (link["origin_id"], link["origin_slot"], link.get("target_id"),
                                 link.get("target_slot"), link.get("type", "*"))
        else:
            link_id, origin, slot, target, target_slot, kind = link[:6]
            links[link_id] = (origin, slot, target, target_slot, kind)
    return links


def _subgraph_definitions(ui: dict) -> dict[str, dict]:
    """Every subgraph definition by id (root `definitions` and nested ones)."""
    found: dict[str, dict] = {}
    pending = list((ui.get("definitions") or {}).get("subgraphs") or [])
    while pending:
        sub = pending.pop()
        if sub.get("id") in found:
            continue
        found[sub["id"]] = sub
        pending += (sub.get("definitions") or {}).get("subgraphs") or []
    return found


class _Scope:
    """One graph being converted: the root, or a subgraph seen through its instance node."""

    def __init__(self, graph: dict, prefix: str, instance: dict | None, parent: _Scope | None,
                 label: str):
        self.graph = graph
        self.prefix = prefix  # "" at the root, "12:" inside subgraph node 12
        self.instance = instance  # the subgraph node in the parent graph
        self.parent = parent
        self.label = label
        self.nodes = {node["id"]: node for node in graph.get("nodes") or []}
        self.links = _links_by_id(graph)

    def api_id(self, node_id: Any) -> str:
        return f"{self.prefix}{node_id}"

    def promoted_value(self, input_index: int) -> tuple[bool, Any]:
        """(True, value) when subgraph input `input_index` is a promoted widget with a value."""
        inputs = self.instance.get("inputs") or []
        if input_index >= len(inputs) or not inputs[input_index].get("widget"):
            return False, None
        slot = inputs[input_index]
        named = self.instance.get("widgets_values_named")
        values = self.instance.get("widgets_values")
        promoted = [i for i in inputs if i.get("widget")]
        if isinstance(values, list) and len(values) == len(promoted):
            return True, values[promoted.index(slot)]
        if isinstance(named, dict) and slot["widget"]["name"] in named:
            return True, named[slot["widget"]["name"]]
        return False, None


class _Converter:
    def __init__(self, ui: dict, object_info: dict):
        self.object_info = object_info
        self.definitions = _subgraph_definitions(ui)
        self.problems: list[Problem] = []
        self.prompt: ApiPrompt = {}
        self.root = _Scope(ui, "", None, None, "")

    def where(self, scope: _Scope, node: dict) -> str:
        title = node.get("title") or node.get("type")
        inside = f" in subgraph '{scope.label}'" if scope.label else ""
        return f"node #{scope.api_id(node['id'])} '{title}' ({node.get('type')}){inside}"

    # ------------------------------------------------------------------ link resolution
    def resolve(self, scope: _Scope, link_id: Any, depth: int = 0) -> Any:
        """A link as the editor sends it: ["id", slot], ("value", v) for a promoted widget,
        or None when its source is muted, missing or editor-only."""
        if link_id not in scope.links or depth > 64:
            return None
        origin_id, slot, _target, _target_slot, kind = scope.links[link_id]
        if origin_id == SUBGRAPH_INPUT_NODE:
            if scope.instance is None:
                return None
            promoted, value = scope.promoted_value(slot)
            if promoted:
                return ("value", value)
            outer = (scope.instance.get("inputs") or [])
            if slot >= len(outer) or outer[slot].get("link") is None:
                return None
            return self.resolve(scope.parent, outer[slot]["link"], depth + 1)
        origin = scope.nodes.get(origin_id)
        if origin is None:
            return None
        kind_of = origin.get("type")
        if kind_of == "PrimitiveNode":
            return "widget"  # the target keeps the value in its own widgets_values
        if kind_of == "Reroute" or origin.get("mode") == MODE_BYPASSED:
            upstream = _pass_through_link(origin, slot, kind)
            return None if upstream is None else self.resolve(scope, upstream, depth + 1)
        if origin.get("mode") == MODE_MUTED or kind_of in UI_ONLY_TYPES:
            return None
        if kind_of in self.definitions:
            inner = self.scope_of(scope, origin)
            outputs = self.definitions[kind_of].get("outputs") or []
            if slot >= len(outputs):
                return None
            for inner_link in outputs[slot].get("linkIds") or []:
                return self.resolve(inner, inner_link, depth + 1)
            return None
        return [scope.api_id(origin_id), slot]

    def scope_of(self, scope: _Scope, instance: dict) -> _Scope:
        sub = self.definitions[instance["type"]]
        label = instance.get("title") or sub.get("name") or instance["type"]
        return _Scope(sub, f"{scope.api_id(instance['id'])}:", instance, scope, label)

    # ------------------------------------------------------------------ nodes
    def convert(self, scope: _Scope) -> None:
        for node in scope.graph.get("nodes") or []:
            kind = node.get("type")
            if kind in UI_ONLY_TYPES or node.get("mode") in (MODE_MUTED, MODE_BYPASSED):
                continue
            if kind in self.definitions:
                if (node.get("properties") or {}).get("proxyWidgets"):
                    self.problems.append(Problem(self.where(scope, node), "its promoted widgets "
                                                 "use an older editor's format (proxyWidgets); "
                                                 "open the workflow in the editor and save it"))
                self.convert(self.scope_of(scope, node))
                continue
            if str(kind).startswith(("workflow>", "workflow/")):
                self.problems.append(Problem(self.where(scope, node), "legacy group nodes are "
                                             "not supported; convert it to a subgraph in the "
                                             "editor or export the workflow in API format"))
                continue
            self.convert_node(scope, node)

    def convert_node(self, scope: _Scope, node: dict) -> None:
        kind = node.get("type")
        info = self.object_info.get(kind)
        inputs: dict[str, Any] = {}
        if info is None:
            self.problems.append(Problem(self.where(scope, node), f"class '{kind}' is not "
                                         "installed on the server; install the node pack that "
                                         "provides it (or update ComfyUI)"))
        else:
            values = editor.widget_values_by_input(info, node.get("widgets_values"))
            for widget in editor.widgets(info, values):
                if widget.input is not None:
                    inputs[widget.input] = _api_value(values.get(
                        widget.input, editor.default_value(widget.kind, widget.options)))
        for slot in node.get("inputs") or []:
            if slot.get("link") is None:
                continue
            target = self.resolve(scope, slot["link"])
            if target == "widget":
                continue
            if isinstance(target, tuple):  # a promoted widget's value
                inputs[slot["name"]] = _api_value(target[1])
            elif target is None:
                # Source muted or missing: the input stays unset (or keeps its widget value)
                # and validation reports it if it was required.
                continue
            else:
                inputs[slot["name"]] = target
        title = node.get("title") or (info or {}).get("display_name") or kind
        meta: dict[str, Any] = {"title": title}
        cnr = (node.get("properties") or {}).get("cnr_id")
        if isinstance(cnr, str) and cnr:
            meta["cnr_id"] = cnr  # the editor passes the node pack's id along
        self.prompt[scope.api_id(node["id"])] = {"inputs": inputs, "class_type": kind,
                                                 "_meta": meta}


def ui_to_api(ui: dict, object_info: dict) -> ApiPrompt:
    """Convert an editor workflow to API format; raise WorkflowError listing every problem.

    Notes, Markdown notes and Reroutes are dropped (reroutes resolved to their source); muted
    nodes are dropped with the links they feed; bypassed nodes pass an input of the same type
    through; subgraphs are expanded as the editor queues them.
    """
    converter = _Converter(ui, object_info)
    converter.convert(converter.root)
    if converter.problems:
        raise WorkflowError(converter.problems, "the UI workflow cannot be converted to API "
                            "format")
    prompt = converter.prompt
    # Links into nodes that were left out (muted, missing) are dropped, as the editor does.
    for node in prompt.values():
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list) and len(value) == 2 and str(value[0]) not in prompt:
                del node["inputs"][name]
    return dict(sorted(prompt.items(), key=lambda item: api_sort_key(item[0])))


def _api_value(value: Any) -> Any:
    """A widget value as the editor queues it: a list would read as a link, so the editor sends
    it as `{"__value__": [...]}` (frontend 1.58 graphToPrompt)."""
    return {"__value__": value} if isinstance(value, list) else value


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
