"""Workflow files checked for the shapes the converter and the graph checks read, before they
read them: a hand-edited, truncated-and-repaired or foreign file gets one line per defect,
naming the node (or link, or subgraph) and the field, instead of a Python error.

What is checked is what the editor writes and what `workflow.py`, `params.py` and
`validate.py` read, no more: unknown extra fields are ignored as the editor ignores them, and
a `null` entry in a `links` list is skipped as the editor's loader skips it.

- UI format: `nodes` a list of objects with an `id` (number or text, unique in its graph) and a
  `type` (text); a node's `inputs` a list of slots `{name, link, widget?}`, `widgets_values` a
  list or an object, `properties` an object; `links` entries `[id, origin, slot, target,
  target slot, type]` or objects with `id`, `origin_id`, `origin_slot`; subgraph definitions
  with an `id`, their own `nodes`/`links`, `inputs`/`outputs` lists, and no subgraph that
  contains itself.
- API format: text node ids; each node an object with a `class_type` (text) and an `inputs`
  object whose list values are links `["node_id", slot]` (ComfyUI reads every list as one);
  `_meta` an object (ComfyUI ignores it, so another shape is only a note: the node cannot be
  found by title).
"""

from __future__ import annotations

from typing import Any

from .errors import Problem, shown

UI_HEADLINE = ("the editor workflow is not as ComfyUI's editor writes it; open it in the editor "
               "and save it again, or export it in API format (Workflow > Export (API))")
API_HEADLINE = ("the API workflow is not as ComfyUI reads it; fix the file or export it again "
                "from the editor (Workflow > Export (API))")


def _kind(value: Any) -> str:
    """How JSON would call `value`'s type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "text", type(None): "null", int: "a number",
            float: "a number"}.get(type(value), f"a {type(value).__name__}")


def _is_id(value: Any) -> bool:
    """A node or link id as the editor writes them: a number or text (not a boolean)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value != "")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _UIChecker:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    # -- one graph: the root or a subgraph definition --------------------------------------

    def graph(self, graph: dict, label: str) -> None:
        inside = f" in subgraph '{label}'" if label else ""
        nodes = graph.get("nodes")
        if nodes is not None and not isinstance(nodes, list):
            self.add(f"{'subgraph ' + repr(label) if label else 'the workflow'}",
                     f"its 'nodes' is {_kind(nodes)}, not a list of nodes")
            nodes = []
        seen: set = set()
        for index, node in enumerate(nodes or []):
            self.node(node, index, inside, seen)
        links = graph.get("links")
        if links is not None and not isinstance(links, list):
            self.add(f"{'subgraph ' + repr(label) if label else 'the workflow'}",
                     f"its 'links' is {_kind(links)}, not a list of links")
            links = []
        for index, link in enumerate(links or []):
            self.link(link, index, inside)

    def node(self, node: Any, index: int, inside: str, seen: set) -> None:
        if not isinstance(node, dict):
            self.add(f"nodes[{index}]{inside}", f"is {_kind(node)} ({shown(node)}), not a node "
                     f"object")
            return
        node_id, kind = node.get("id"), node.get("type")
        title = node.get("title")
        name = f" '{title}'" if isinstance(title, str) and title else ""
        where = (f"node #{node_id}{name} ({kind if isinstance(kind, str) else '?'}){inside}"
                 if _is_id(node_id) else f"nodes[{index}]{name}{inside}")
        if "id" not in node:
            self.add(where, "has no 'id'")
        elif not _is_id(node_id):
            self.add(where, f"its 'id' is {_kind(node_id)} ({shown(node_id)}), not a number")
        elif node_id in seen:
            self.add(where, f"its id {node_id!r} is used by another node of the same graph")
        else:
            seen.add(node_id)
        if not isinstance(kind, str) or not kind:
            self.add(where, f"its 'type' is {_kind(kind)} ({shown(kind)}), not a node class "
                     f"name")
        for field, allowed, wanted in (
                ("title", (str,), "text"), ("properties", (dict,), "an object"),
                ("widgets_values", (list, dict), "a list of widget values"),
                ("widgets_values_named", (dict,), "an object of widget values"),
                ("inputs", (list,), "a list of input slots")):
            value = node.get(field)
            if value is not None and not isinstance(value, allowed):
                self.add(where, f"its '{field}' is {_kind(value)} ({shown(value)}), not {wanted}")
        mode = node.get("mode")
        if mode is not None and not _is_index(mode):
            self.add(where, f"its 'mode' is {_kind(mode)} ({shown(mode)}), not a number "
                     f"(0 always, 2 muted, 4 bypassed)")
        inputs = node.get("inputs")
        for slot_index, slot in enumerate(inputs if isinstance(inputs, list) else []):
            self.slot(slot, f"{where}, input slot {slot_index}")

    def slot(self, slot: Any, where: str) -> None:
        if not isinstance(slot, dict):
            self.add(where, f"is {_kind(slot)} ({shown(slot)}), not an input slot object")
            return
        name, link, widget = slot.get("name"), slot.get("link"), slot.get("widget")
        if not isinstance(name, str):
            self.add(where, f"its 'name' is {_kind(name)} ({shown(name)}), not the input's name")
        if link is not None and not _is_id(link):
            self.add(where, f"its 'link' is {_kind(link)} ({shown(link)}), not a link id")
        if widget is not None and not (isinstance(widget, dict)
                                       and isinstance(widget.get("name"), str)):
            self.add(where, f"its 'widget' is {shown(widget)}, not {{\"name\": ...}}")

    def link(self, link: Any, index: int, inside: str) -> None:
        if link is None:
            return  # the editor's loader skips such entries too
        if isinstance(link, list):
            where = f"link #{link[0]}{inside}" if link and _is_id(link[0]) else \
                f"links[{index}]{inside}"
            if len(link) < 6:
                self.add(where, f"has {len(link)} entries ({shown(link)}); a link is [id, origin "
                         f"node, origin slot, target node, target slot, type]")
                return
            link_id, origin, slot = link[0], link[1], link[2]
            fields = (("id", link_id), ("origin node", origin))
        elif isinstance(link, dict):
            link_id, origin, slot = link.get("id"), link.get("origin_id"), link.get("origin_slot")
            where = f"link #{link_id}{inside}" if _is_id(link_id) else f"links[{index}]{inside}"
            fields = (("'id'", link_id), ("'origin_id'", origin))
        else:
            self.add(f"links[{index}]{inside}", f"is {_kind(link)} ({shown(link)}), not a link")
            return
        for field, value in fields:
            if not _is_id(value):
                self.add(where, f"its {field} is {_kind(value)} ({shown(value)}), not an id")
        if not _is_index(slot):
            self.add(where, f"its origin slot is {_kind(slot)} ({shown(slot)}), not an output "
                     f"index")

    # -- subgraph definitions -----------------------------------------------------------

    def definitions(self, holder: dict, where: str, found: dict[str, dict]) -> None:
        definitions = holder.get("definitions")
        if definitions is None:
            return
        subgraphs = definitions.get("subgraphs") if isinstance(definitions, dict) else None
        if not isinstance(definitions, dict) or not isinstance(subgraphs, (list, type(None))):
            self.add(where, f"its 'definitions' is {shown(definitions)}, not "
                     f"{{\"subgraphs\": [...]}}")
            return
        for index, sub in enumerate(subgraphs or []):
            if not isinstance(sub, dict):
                self.add(f"subgraph definition {index}", f"is {_kind(sub)} ({shown(sub)}), not "
                         f"a subgraph object")
                continue
            sub_id = sub.get("id")
            label = sub.get("name") if isinstance(sub.get("name"), str) else str(sub_id)
            if not isinstance(sub_id, str) or not sub_id:
                self.add(f"subgraph definition {index} '{label}'", f"its 'id' is "
                         f"{_kind(sub_id)} ({shown(sub_id)}), not the subgraph's id")
                continue
            if sub_id in found:
                continue
            found[sub_id] = sub
            for field in ("inputs", "outputs"):
                value = sub.get(field)
                if value is not None and not (isinstance(value, list)
                                              and all(isinstance(v, dict) for v in value)):
                    self.add(f"subgraph '{label}'", f"its '{field}' is {shown(value)}, not a "
                             f"list of its {field[:-1]} objects")
            for out_index, output in enumerate(sub.get("outputs") or []):
                ids = output.get("linkIds") if isinstance(output, dict) else None
                if ids is not None and not (isinstance(ids, list) and all(
                        _is_id(i) for i in ids)):
                    self.add(f"subgraph '{label}', output {out_index}",
                             f"its 'linkIds' is {shown(ids)}, not a list of link ids")
            self.graph(sub, label)
            self.definitions(sub, f"subgraph '{label}'", found)

    def cycles(self, ui: dict, found: dict[str, dict]) -> None:
        """A subgraph that contains itself (directly or through others) never ends expanding."""
        def types(graph: dict) -> list[str]:
            nodes = graph.get("nodes")
            return [n.get("type") for n in nodes if isinstance(n, dict)] if isinstance(
                nodes, list) else []

        state: dict[str, str] = {}  # "open" while on the current path, "done" after

        def visit(sub_id: str, path: list[str]) -> None:
            if state.get(sub_id) == "done":
                return
            if state.get(sub_id) == "open":
                names = [str(found[s].get("name") or s) for s in path[path.index(sub_id):]]
                self.add(f"subgraph '{names[0]}'", "contains itself ("
                         + " > ".join(f"'{n}'" for n in [*names, names[0]]) + ")")
                return
            state[sub_id] = "open"
            for kind in types(found[sub_id]):
                if isinstance(kind, str) and kind in found:
                    visit(kind, [*path, sub_id])
            state[sub_id] = "done"

        for kind in types(ui):
            if isinstance(kind, str) and kind in found:
                visit(kind, [])


def check_ui(ui: dict) -> list[Problem]:
    """Every shape defect of an editor (UI format) workflow; empty when it can be converted."""
    checker = _UIChecker()
    checker.graph(ui, "")
    found: dict[str, dict] = {}
    checker.definitions(ui, "the workflow", found)
    if not checker.problems:
        checker.cycles(ui, found)
    return checker.problems


def check_api(prompt: dict) -> tuple[list[Problem], list[Problem]]:
    """(problems, notes) of an API-format graph's shape, before anything reads it."""
    problems: list[Problem] = []
    notes: list[Problem] = []
    for node_id, node in prompt.items():
        if not isinstance(node_id, str):
            problems.append(Problem(f"node id {node_id!r}", f"is {_kind(node_id)}, not text; "
                                    f"ComfyUI's node ids are strings such as \"5\""))
            continue
        if not isinstance(node, dict):
            problems.append(Problem(f"node #{node_id}", f"is {_kind(node)} ({shown(node)}), not "
                                    f"a node {{\"class_type\": ..., \"inputs\": {{...}}}}"))
            continue
        class_type = node.get("class_type")
        where = f"node #{node_id} ({class_type if isinstance(class_type, str) else '?'})"
        if not isinstance(class_type, str) or not class_type:
            problems.append(Problem(where, f"its 'class_type' is {_kind(class_type)} "
                                    f"({shown(class_type)}), not a node class name"))
        meta = node.get("_meta")
        if meta is not None and not isinstance(meta, dict):
            notes.append(Problem(where, f"its '_meta' is {_kind(meta)} ({shown(meta)}), not "
                                 f"{{\"title\": ...}}; ComfyUI ignores it, but no parameter "
                                 f"can find this node by its title"))
        inputs = node.get("inputs")
        if not isinstance(inputs, dict):
            what = "has no 'inputs'" if "inputs" not in node else (
                f"its 'inputs' is {_kind(inputs)} ({shown(inputs)})")
            problems.append(Problem(where, f"{what}; ComfyUI needs an object of input names "
                                    f"and values (an empty one for a node without inputs)"))
            continue
        for name, value in inputs.items():
            if not isinstance(name, str):
                problems.append(Problem(where, f"input name {name!r} is {_kind(name)}, not text"))
            elif isinstance(value, list) and not (
                    len(value) == 2 and isinstance(value[0], str) and _is_index(value[1])):
                problems.append(Problem(where, f"input '{name}' = {shown(value)}: ComfyUI reads "
                                        f"a list as a link [\"node_id\", output_index] (node id "
                                        f"as text); for a list value write "
                                        f"{{\"__value__\": [...]}}"))
    return problems, notes
