"""A small graph model that writes ComfyUI editor workflows (frontend 1.58) and their API twins.

One description produces both files, so they cannot disagree:
- `ui()`: UI format 0.4 with one subgraph (`definitions.subgraphs`), the way the editor saves
  it: every node's input slots in the editor's order (`client/editor.py`), link records whose
  target slot is the index of the input that carries them, `widgets_values` in widget order,
  promoted widgets as subgraph inputs wired to inner widget inputs, groups, a Markdown note,
  native reroutes (a subgraph's `reroutes`, each link's `parentId`: the last one on its way);
- `api()`: what the editor's `graphToPrompt()` sends: subgraph nodes flattened to
  `"<subgraph node id>:<inner id>"`, promoted values written onto the inner inputs, links
  through the subgraph's inputs and outputs resolved to the real nodes, notes left out.

Node schemas are `/object_info` entries (tests/data/object_info_h3.json for core nodes,
tests/data/object_info_pack.json for this pack's). Ids of nodes and links are unique across the
whole workflow (the editor shares one counter between a graph and its subgraphs); UUIDs are
derived from the workflow's name, so regenerating gives the same files.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import wire_geometry as wires

from h3_multigpu.client import editor
from h3_multigpu.client.workflow import api_sort_key

NOTE_TYPE = "MarkdownNote"  # editor-only: one text widget, never sent to the server
SUBGRAPH_INPUT_ID = -10
SUBGRAPH_OUTPUT_ID = -20
OPTIONAL_SHAPE = 7  # the editor's hollow-socket shape for optional inputs
PACK_CNR = "comfyui-h3-multigpu"
NAMESPACE = uuid.UUID("6f1d2c3a-5b4e-4f8a-9c7d-2e1f0a3b4c5d")

HELPER, ROOT, PLAIN = "helper", "root", "plain"
COLORS = {HELPER: ("#223b5a", "#335a88"), ROOT: ("#5a3a1c", "#88582b"), PLAIN: (None, None)}
GROUP_COLORS = {HELPER: "#335a88", ROOT: "#88582b", PLAIN: "#444444"}


def stable_uuid(*parts: str) -> str:
    return str(uuid.uuid5(NAMESPACE, "/".join(parts)))


@dataclass(frozen=True)
class Ref:
    """A link source: output `output` (a name) of `node` (a Node, SubgraphInput or Subgraph)."""

    node: Any
    output: str


@dataclass(eq=False)
class Node:
    id: int
    type: str
    title: str
    pos: tuple[float, float]
    role: str
    values: dict  # API input name -> literal or Ref
    width: float = 380
    height: float | None = None
    graph: Any = None
    order: int = 0

    def ref(self, output: str) -> Ref:
        return Ref(self, output)


@dataclass(eq=False)
class SubgraphInput:
    """A subgraph input: `widget=True` promotes an inner widget to the subgraph node, with
    `value`; otherwise it is a socket the parent graph links into."""

    name: str
    type: str
    label: str
    widget: bool
    value: Any = None
    optional: bool = False
    index: int = 0

    def ref(self) -> Ref:
        return Ref(self, self.name)


@dataclass(eq=False)
class SubgraphOutput:
    name: str
    type: str
    source: Ref
    index: int = 0


@dataclass
class Group:
    title: str
    role: str
    members: list


@dataclass(eq=False)
class Reroute:
    """A native reroute (a point a wire passes through); `parent` is the reroute before it on
    the way from the output. Editor-only: the API format never sees it."""

    id: int
    pos: tuple[float, float]
    parent: Reroute | None = None


@dataclass(eq=False)
class Graph:
    """The root graph or a subgraph's inside; `workflow` hands out the shared ids."""

    workflow: Any
    nodes: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    reroutes: list = field(default_factory=list)
    via: dict = field(default_factory=dict)  # (id(target), input name) -> its last Reroute

    def add(self, type_: str, title: str, pos: tuple[float, float], role: str = PLAIN, *,
            box: tuple[float, float | None] = (380, None), **values) -> Node:
        """A node at `pos`; `box` = (width, height or None to size it from its slots)."""
        wf = self.workflow
        if type_ != NOTE_TYPE and not isinstance(type_, Subgraph):
            declared = {name for name, *_ in editor.declared_inputs(wf.schema(type_))}
            grown = {n for name, kind, opts, _ in editor.declared_inputs(wf.schema(type_))
                     if kind == editor.AUTOGROW for n in editor.autogrow_names(name, opts)}
            unknown = set(values) - declared - grown - set(self._dynamic_names(type_, values))
            assert not unknown, f"{type_} has no inputs {sorted(unknown)}"
        node = Node(wf.next_node_id(), type_, title, pos, role, values, box[0], box[1], self)
        self.nodes.append(node)
        return node

    def _dynamic_names(self, type_: str, values: dict) -> list[str]:
        return [w.input for w in editor.widgets(self.workflow.schema(type_), values) if w.input]

    def group(self, title: str, role: str, members: list) -> None:
        self.groups.append(Group(title, role, members))

    def reroute(self, pos: tuple[float, float], parent: Reroute | None = None) -> Reroute:
        point = Reroute(len(self.reroutes) + 1, pos, parent)
        self.reroutes.append(point)
        return point

    def route(self, target: Any, name: str, last: Reroute) -> None:
        """Send the wire into `target`'s input `name` through `last` (and its parents)."""
        self.via[(id(target), name)] = last


@dataclass(eq=False)
class Subgraph(Graph):
    name: str = ""
    uuid: str = ""
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    input_pos: tuple[float, float] = (0, 0)
    output_pos: tuple[float, float] = (0, 0)
    input_width: float = 180

    def promote(self, name: str, type_: str, value: Any, label: str | None = None) -> Ref:
        item = SubgraphInput(name, type_, label or name, True, value, index=len(self.inputs))
        self.inputs.append(item)
        return item.ref()

    def socket(self, name: str, type_: str, label: str | None = None,
               optional: bool = True) -> Ref:
        item = SubgraphInput(name, type_, label or name, False, None, optional,
                             len(self.inputs))
        self.inputs.append(item)
        return item.ref()

    def output(self, name: str, type_: str, source: Ref) -> None:
        self.outputs.append(SubgraphOutput(name, type_, source, len(self.outputs)))


class Workflow:
    def __init__(self, name: str, schemas: dict[str, dict]):
        self.name = name
        self.schemas = schemas
        self.root = Graph(self)
        self.subgraphs: list[Subgraph] = []
        self._node_id = 0
        self._links: dict[tuple[int, str], int] = {}  # (target node id, input) -> link id
        self.extra: dict = {}

    # ------------------------------------------------------------------ construction
    def next_node_id(self) -> int:
        self._node_id += 1
        return self._node_id

    def schema(self, type_: str) -> dict:
        if type_ not in self.schemas:
            raise KeyError(f"no schema for {type_}; add it to tests/data")
        return self.schemas[type_]

    def subgraph(self, name: str, input_pos, output_pos) -> Subgraph:
        sub = Subgraph(self, name=name, uuid=stable_uuid(self.name, "subgraph", name),
                       input_pos=input_pos, output_pos=output_pos)
        self.subgraphs.append(sub)
        return sub

    # ------------------------------------------------------------------ node layout
    def _info(self, node: Node) -> dict | None:
        if node.type == NOTE_TYPE or isinstance(node.type, Subgraph):
            return None
        return self.schema(node.type)

    def _literals(self, node: Node) -> dict:
        """Widget values as the node stores them: linked widgets keep the linked literal."""
        return {k: self._literal(v) for k, v in node.values.items()}

    def _literal(self, value: Any) -> Any:
        if not isinstance(value, Ref):
            return value
        src = value.node
        if isinstance(src, SubgraphInput):
            return src.value
        if not isinstance(src, Node) or isinstance(src.type, Subgraph):
            return None
        if src.type.startswith("Primitive"):
            return self._literal(src.values.get("value"))
        if src.type == "H3MultiGPUSeconds":
            from h3_multigpu.common.geometry import FPS, snap_frames

            frames = snap_frames(self._literal(src.values["seconds"]))
            return frames if value.output == "frames" else frames / FPS
        return None

    def slots(self, node: Node) -> list[editor.Slot]:
        if isinstance(node.type, Subgraph):
            return [editor.Slot(i.name, i.type, i.optional, i.widget, i.label)
                    for i in node.type.inputs]
        info = self._info(node)
        if info is None:
            return []
        linked = {k for k, v in node.values.items() if isinstance(v, Ref)}
        return editor.slots(info, self._literals(node), linked)

    def outputs(self, node: Node) -> list[tuple[str, str]]:
        if isinstance(node.type, Subgraph):
            return [(o.name, o.type) for o in node.type.outputs]
        info = self._info(node)
        if info is None:
            return []
        return list(zip(info.get("output_name") or info["output"], info["output"], strict=True))

    def output_index(self, src: Any, name: str) -> int:
        if isinstance(src, SubgraphInput):
            return src.index
        names = [n for n, _ in self.outputs(src)]
        return names.index(name)

    def output_type(self, src: Any, name: str) -> str:
        if isinstance(src, SubgraphInput):
            return src.type
        return self.outputs(src)[self.output_index(src, name)][1]

    def widget_values(self, node: Node) -> list:
        if isinstance(node.type, Subgraph):
            return [i.value for i in node.type.inputs if i.widget]
        if node.type == NOTE_TYPE:
            return [node.values["text"]]
        info = self._info(node)
        literals = self._literals(node)
        values = []
        for widget in editor.widgets(info, literals):
            if widget.name == editor.CONTROL_WIDGET:
                values.append("fixed")
            elif widget.name == editor.UPLOAD_WIDGET:
                values.append("image")
            else:
                value = literals.get(widget.input)
                values.append(editor.default_value(widget.kind, widget.options)
                              if value is None else value)
        return values

    def widget_names(self, node: Node) -> list[str]:
        if isinstance(node.type, Subgraph):
            return [i.name for i in node.type.inputs if i.widget]
        if node.type == NOTE_TYPE:
            return ["text"]
        return [w.name for w in editor.widgets(self._info(node), self._literals(node))]

    # ------------------------------------------------------------------ links
    def _edges(self, graph: Graph) -> list[tuple[Any, str, Node | SubgraphOutput, str]]:
        """(source, output, target, input) of every link inside `graph`."""
        edges = []
        for node in graph.nodes:
            for name, value in node.values.items():
                if isinstance(value, Ref):
                    edges.append((value.node, value.output, node, name))
        if isinstance(graph, Subgraph):
            for out in graph.outputs:
                edges.append((out.source.node, out.source.output, out, out.name))
        return edges

    def _assign_link_ids(self) -> None:
        self._links = {}
        next_id = 0
        for graph in [self.root, *self.subgraphs]:
            for _src, _out, target, name in self._edges(graph):
                next_id += 1
                self._links[(id(target), name)] = next_id
        self.last_link_id = next_id

    def _link_id(self, target: Any, name: str) -> int | None:
        return self._links.get((id(target), name))

    def _order(self, graph: Graph) -> None:
        done: list[Node] = []
        deps = {id(n): [v.node for v in n.values.values()
                        if isinstance(v, Ref) and isinstance(v.node, Node)] for n in graph.nodes}
        while len(done) < len(graph.nodes):
            for node in graph.nodes:
                if node not in done and all(d in done for d in deps[id(node)]):
                    node.order = len(done)
                    done.append(node)

    # ------------------------------------------------------------------ UI format
    def _size(self, node: Node) -> list[float]:
        if node.height is not None:
            return [node.width, node.height]
        # What the editor's computeSize asks (it grows a node loaded shorter).
        entry = {"type": node.type, "inputs": [{"widget": {}} if slot.widget else {}
                                                for slot in self.slots(node)],
                 "outputs": self.outputs(node), "size": [node.width, 0],
                 "widgets_values_named": self._literals(node)}
        return [node.width, wires.least_height(entry, self.schemas)]

    def _ui_node(self, node: Node, in_subgraph: bool) -> dict:
        inputs = []
        for slot in self.slots(node):
            entry: dict[str, Any] = {}
            if isinstance(node.type, Subgraph):
                if slot.label != slot.name:
                    entry["label"] = slot.label
            else:
                entry["localized_name"] = slot.label
            entry["name"] = slot.name
            if slot.optional:
                entry["shape"] = OPTIONAL_SHAPE
            entry["type"] = slot.type
            if slot.widget:
                entry["widget"] = {"name": slot.name}
            entry["link"] = self._link_id(node, slot.name)
            inputs.append(entry)
        outputs = []
        for index, (name, kind) in enumerate(self.outputs(node)):
            links = [self._link_id(t, n) for s, o, t, n in self._edges(node.graph)
                     if s is node and self.output_index(s, o) == index]
            if not in_subgraph and isinstance(node.type, Subgraph):
                links = [self._link_id(t, n) for s, o, t, n in self._edges(self.root)
                         if s is node and self.output_index(s, o) == index]
            outputs.append({"localized_name": name, "name": name, "type": kind,
                            "links": sorted(links) or None})
        kind = node.type.uuid if isinstance(node.type, Subgraph) else node.type
        entry = {"id": node.id, "type": kind, "pos": [int(node.pos[0]), int(node.pos[1])],
                 "size": self._size(node), "flags": {}, "order": node.order, "mode": 0,
                 "inputs": inputs, "outputs": outputs, "title": node.title,
                 "properties": self._properties(node)}
        names = self.widget_names(node)
        if names:
            values = self.widget_values(node)
            entry["widgets_values"] = values
            entry["widgets_values_named"] = dict(zip(names, values, strict=True))
        color, bgcolor = COLORS[node.role]
        if color:
            entry["color"], entry["bgcolor"] = color, bgcolor
        return entry

    def _properties(self, node: Node) -> dict:
        if isinstance(node.type, Subgraph) or node.type == NOTE_TYPE:
            return {}
        cnr = PACK_CNR if node.type.startswith("H3MultiGPU") else "comfy-core"
        props = {"cnr_id": cnr, "Node name for S&R": node.type}
        models = self.model_links(node)
        if models:
            props["models"] = models
        return props

    def model_links(self, node: Node) -> list[dict]:
        return []  # overridden by the workflow description (file names -> download links)

    def _group_boxes(self, graph: Graph) -> list[dict]:
        boxes = []
        for index, group in enumerate(graph.groups, start=1):
            x0 = min(n.pos[0] for n in group.members) - 20
            y0 = min(n.pos[1] for n in group.members) - 70
            x1 = max(n.pos[0] + self._size(n)[0] for n in group.members) + 20
            y1 = max(n.pos[1] + self._size(n)[1] for n in group.members) + 20
            boxes.append({"id": index, "title": group.title,
                          "bounding": [int(x0), int(y0), int(x1 - x0), int(y1 - y0)],
                          "color": GROUP_COLORS[group.role], "flags": {}})
        return boxes

    def _link_object(self, src: Any, out: str, target: Any, name: str) -> dict:
        origin = SUBGRAPH_INPUT_ID if isinstance(src, SubgraphInput) else src.id
        if isinstance(target, SubgraphOutput):
            target_id, slot = SUBGRAPH_OUTPUT_ID, target.index
        else:
            target_id = target.id
            slot = [s.name for s in self.slots(target)].index(name)
        link = {"id": self._link_id(target, name), "origin_id": origin,
                "origin_slot": self.output_index(src, out), "target_id": target_id,
                "target_slot": slot, "type": self.output_type(src, out)}
        last = self._graph_of(target).via.get((id(target), name))
        if last is not None:
            link["parentId"] = last.id
        return link

    def _graph_of(self, target: Any) -> Graph:
        if isinstance(target, SubgraphOutput):
            return next(s for s in self.subgraphs if target in s.outputs)
        return target.graph

    def _reroutes(self, graph: Graph) -> list[dict]:
        """The graph's reroutes as the editor saves them, each with the links through it."""
        through: dict[int, list[int]] = {}
        for key, last in graph.via.items():
            link_id = self._links[key]
            point = last
            while point is not None:
                through.setdefault(point.id, []).append(link_id)
                point = point.parent
        out = []
        for point in graph.reroutes:
            entry: dict[str, Any] = {"id": point.id}
            if point.parent is not None:
                entry["parentId"] = point.parent.id
            entry["pos"] = [round(point.pos[0], 1), round(point.pos[1], 1)]
            entry["linkIds"] = sorted(through.get(point.id, []))
            out.append(entry)
        return out

    def _subgraph_definition(self, sub: Subgraph) -> dict:
        edges = self._edges(sub)
        links = sorted((self._link_object(*e) for e in edges), key=lambda link: link["id"])
        inputs = []
        for item in sub.inputs:
            entry = {"id": stable_uuid(self.name, sub.name, "input", item.name),
                     "name": item.name, "type": item.type,
                     "linkIds": sorted(self._link_id(t, n) for s, _, t, n in edges
                                       if s is item)}
            if item.label != item.name:
                entry["label"] = item.label
            entry["pos"] = [sub.input_pos[0] + sub.input_width - 20,
                            sub.input_pos[1] + 20 + 20 * item.index]
            inputs.append(entry)
        outputs = []
        for item in sub.outputs:
            outputs.append({"id": stable_uuid(self.name, sub.name, "output", item.name),
                            "name": item.name, "type": item.type,
                            "linkIds": [self._link_id(item, item.name)],
                            "localized_name": item.name,
                            "pos": [sub.output_pos[0] + 20, sub.output_pos[1] + 20
                                    + 20 * item.index]})
        return {
            "id": sub.uuid, "version": 1,
            "state": {"lastGroupId": len(sub.groups), "lastNodeId": self._node_id,
                      "lastLinkId": self.last_link_id, "lastRerouteId": len(sub.reroutes)},
            "revision": 0, "config": {}, "name": sub.name,
            "inputNode": {"id": SUBGRAPH_INPUT_ID,
                          "bounding": [*sub.input_pos, sub.input_width,
                                       40 + 20 * len(sub.inputs)]},
            "outputNode": {"id": SUBGRAPH_OUTPUT_ID,
                           "bounding": [*sub.output_pos, 140, 40 + 20 * len(sub.outputs)]},
            "inputs": inputs, "outputs": outputs, "widgets": [],
            "nodes": [self._ui_node(n, True) for n in sub.nodes],
            "groups": self._group_boxes(sub), "links": links,
            **({"reroutes": self._reroutes(sub)} if sub.reroutes else {}), "extra": {},
        }

    def ui(self) -> dict:
        self._assign_link_ids()
        for graph in [self.root, *self.subgraphs]:
            self._order(graph)
        root_links = []
        for src, out, target, name in self._edges(self.root):
            link = self._link_object(src, out, target, name)
            root_links.append([link["id"], link["origin_id"], link["origin_slot"],
                               link["target_id"], link["target_slot"], link["type"]])
        return {
            "id": stable_uuid(self.name, "workflow"),
            "revision": 0,
            "last_node_id": self._node_id,
            "last_link_id": self.last_link_id,
            "nodes": [self._ui_node(n, False) for n in self.root.nodes],
            "links": sorted(root_links),
            "groups": self._group_boxes(self.root),
            "definitions": {"subgraphs": [self._subgraph_definition(s) for s in self.subgraphs]},
            "config": {},
            "extra": self.extra,
            "version": 0.4,
        }

    # ------------------------------------------------------------------ API format
    def _instance_of(self, sub: Subgraph) -> Node:
        return next(n for n in self.root.nodes if n.type is sub)

    def _resolve(self, ref: Ref, prefix: str) -> Any:
        """A Ref as graphToPrompt sends it: [node id, slot] of a real node, or a literal."""
        src = ref.node
        if isinstance(src, SubgraphInput):
            if src.widget:
                return src.value
            sub = next(s for s in self.subgraphs if src in s.inputs)
            outer = self._instance_of(sub).values[src.name]
            return self._resolve(outer, "")
        if isinstance(src.type, Subgraph):
            out = next(o for o in src.type.outputs if o.name == ref.output)
            return self._resolve(out.source, f"{src.id}:")
        return [f"{prefix}{src.id}", self.output_index(src, ref.output)]

    def _api_node(self, node: Node, prefix: str) -> dict:
        info = self.schema(node.type)
        literals = self._literals(node)
        inputs: dict[str, Any] = {}
        for widget in editor.widgets(info, literals):
            if widget.input is None:
                continue
            value = node.values.get(widget.input)
            if isinstance(value, Ref):
                inputs[widget.input] = self._resolve(value, prefix)
            else:
                inputs[widget.input] = (editor.default_value(widget.kind, widget.options)
                                        if value is None else value)
        for slot in self.slots(node):
            value = node.values.get(slot.name)
            if not slot.widget and isinstance(value, Ref):
                inputs[slot.name] = self._resolve(value, prefix)
        meta = {"title": node.title}
        cnr = self._properties(node).get("cnr_id")
        if cnr:  # graphToPrompt copies the node pack's id into _meta
            meta["cnr_id"] = cnr
        return {"inputs": inputs, "class_type": node.type, "_meta": meta}

    def api(self) -> dict:
        out = {}
        for node in sorted(self.root.nodes, key=lambda n: n.id):
            if node.type == NOTE_TYPE:
                continue
            if isinstance(node.type, Subgraph):
                for inner in sorted(node.type.nodes, key=lambda n: n.id):
                    if inner.type != NOTE_TYPE:
                        out[f"{node.id}:{inner.id}"] = self._api_node(inner, f"{node.id}:")
                continue
            out[str(node.id)] = self._api_node(node, "")
        return dict(sorted(out.items(), key=lambda kv: api_sort_key(kv[0])))
