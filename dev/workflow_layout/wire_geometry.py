"""Where the ComfyUI editor (frontend 1.58.1, canvas renderer) draws a UI workflow's wires.

Read from a saved graph (the root of a workflow or one `definitions.subgraphs` entry) and the
node schemas, the way the editor lays it out after loading:

- slots: an output `k` sits at `(x + w - 9, y + 20 * (k + 0.7))`; a socket input (no widget)
  at `(x + 10, y + 20 * (k + 0.7))`, `k` counting sockets only; a widget's input at its widget's
  row: widgets start under the slot rows (`rows * 20 + 6`), one row is 24 high, a multiline
  text box takes the node's free height (at least `TEXTAREA_MIN`);
- the subgraph's input node puts its slots at `(x + w - 24, y + 24 + 20 * i)`, its output node
  at `(x + 24, y + 24 + 20 * i)`;
- a wire is a cubic Bezier leaving its output to the right and entering its input from the
  left, both control points a quarter of the wire's length away; a wire through native
  reroutes (`reroutes`, `parentId`) is one Bezier per leg, each reroute's tangent the bisector
  of the arriving leg and the mean direction of the legs leaving it, its control points at most
  `REROUTE_MAX_OFFSET` away (the editor's "Reroute spline offset" setting, 20 by default), as
  `Reroute.calculateAngle` computes it.

`tests/browser/` checks this against the Beziers the real editor draws. `crossings` counts the
pairs of wires (of different outputs) whose drawn curves intersect; `overlaps` lists nodes or
groups that overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from h3_multigpu.client import editor

SLOT = 20  # LiteGraph.NODE_SLOT_HEIGHT
WIDGET_ROW = 24  # LiteGraph.NODE_WIDGET_HEIGHT + 4
TITLE = 30  # LiteGraph.NODE_TITLE_HEIGHT: the title bar above a node's pos
TEXTAREA_MIN = 70  # a multiline text box's least height (the editor's CSS, measured)
IO_RADIUS = 14  # SubgraphIONodeBase.roundedRadius
REROUTE_MAX_OFFSET = 20  # LiteGraph.Reroute.SplineOffset, the editor's default
SAMPLES = 32  # points per Bezier when curves are intersected
SUBGRAPH_INPUT_ID = -10
SUBGRAPH_OUTPUT_ID = -20
# Autogrow groups that frontend 1.58.1 grows by free slots while it restores a file's links
# (it does the same to the official r2v template): the extra socket rows push the widgets
# down. {node type: {autogrow input: free slots added}}.
EDITOR_GROWS = {"MiniMaxH3ReferenceToVideo": {"ref_audios": 2}}

Point = tuple[float, float]
Bezier = tuple[Point, Point, Point, Point]


@dataclass(frozen=True)
class Wire:
    """One link as drawn: `origin` = (node id, output slot); `legs` = its Beziers, one per
    stretch between reroutes; `keys` names each leg (("reroute", id) for the leg that ends at
    a reroute, which every link through that reroute shares; ("link", id) for the last)."""

    id: int
    origin: tuple[int, int]
    legs: tuple[Bezier, ...]
    keys: tuple[tuple[str, int], ...] = ()


def _links(graph: dict) -> list[dict]:
    out = []
    for link in graph.get("links") or []:
        if isinstance(link, list):
            out.append({"id": link[0], "origin_id": link[1], "origin_slot": link[2],
                        "target_id": link[3], "target_slot": link[4]})
        else:
            out.append(link)
    return out


def _widget_rows(node: dict, schemas: dict) -> dict[str, float]:
    """Widget name -> top of its row, relative to the node's pos."""
    info = schemas.get(node["type"])
    sockets = [s for s in node.get("inputs") or [] if not s.get("widget")]
    grown = sum(EDITOR_GROWS.get(node["type"], {}).values())
    rows = max(len(sockets) + grown, len(node.get("outputs") or []))
    top = rows * SLOT + 6 if rows else 2
    height = node_height(node, schemas) if info is not None else node["size"][1]
    if info is None:  # a subgraph node: its promoted widgets, one row each
        return {s["widget"]["name"]: top + i * WIDGET_ROW
                for i, s in enumerate(s for s in node.get("inputs") or [] if s.get("widget"))}
    layout = editor.widgets(info, node.get("widgets_values_named") or {})
    growable = [w for w in layout if w.kind == "STRING" and w.options.get("multiline")]
    fixed = WIDGET_ROW * (len(layout) - len(growable))
    free = height - top - fixed
    share = max(TEXTAREA_MIN, free / len(growable)) if growable else 0
    out, y = {}, top
    for widget in layout:
        out[widget.name] = y
        y += share if widget in growable else WIDGET_ROW
    return out


def least_height(node: dict, schemas: dict) -> float:
    """The editor's `computeSize` height: a node loaded shorter is grown to it."""
    info = schemas.get(node["type"])
    sockets = [s for s in node.get("inputs") or [] if not s.get("widget")]
    grown = sum(EDITOR_GROWS.get(node["type"], {}).values())
    rows = max(len(sockets) + grown, len(node.get("outputs") or []), 1)
    if info is None:
        return rows * SLOT + 6
    layout = editor.widgets(info, node.get("widgets_values_named") or {})
    if not layout:
        return rows * SLOT + 6
    tall = sum(1 for w in layout if w.kind == "STRING" and w.options.get("multiline"))
    return rows * SLOT + WIDGET_ROW * (len(layout) - tall) + (TEXTAREA_MIN + 4) * tall + 14


def node_height(node: dict, schemas: dict) -> float:
    """The height the editor gives the node."""
    return max(node["size"][1], least_height(node, schemas))


class Geometry:
    """Slot positions and boxes of one graph as the editor lays it out."""

    def __init__(self, graph: dict, schemas: dict):
        self.graph = graph
        self.nodes = {n["id"]: n for n in graph["nodes"]}
        self.schemas = schemas
        self._rows = {i: _widget_rows(n, schemas) for i, n in self.nodes.items()}

    def output_pos(self, node_id: int, slot: int) -> Point:
        if node_id == SUBGRAPH_INPUT_ID:
            x, y, w, _ = self.graph["inputNode"]["bounding"]
            return (x + w - IO_RADIUS - SLOT / 2, y + IO_RADIUS + SLOT * slot + SLOT / 2)
        node = self.nodes[node_id]
        x, y = node["pos"]
        return (x + node["size"][0] + 1 - SLOT / 2, y + SLOT * (slot + 0.7))

    def input_pos(self, node_id: int, slot: int) -> Point:
        if node_id == SUBGRAPH_OUTPUT_ID:
            x, y, _, _ = self.graph["outputNode"]["bounding"]
            return (x + IO_RADIUS + SLOT / 2, y + IO_RADIUS + SLOT * slot + SLOT / 2)
        node = self.nodes[node_id]
        x, y = node["pos"]
        inputs = node["inputs"]
        if inputs[slot].get("widget"):
            return (x + SLOT / 2, y + self._rows[node_id][inputs[slot]["widget"]["name"]]
                    + SLOT / 2)
        index = sum(1 for s in inputs[:slot] if not s.get("widget"))
        return (x + SLOT / 2, y + SLOT * (index + 0.7))

    def box(self, node_id: int) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) of the node with its title bar."""
        node = self.nodes[node_id]
        x, y = node["pos"]
        return (x, y - TITLE, x + node["size"][0], y + node_height(node, self.schemas))


def _plain(a: Point, b: Point) -> Bezier:
    d = math.dist(a, b) * 0.25
    return (a, (a[0] + d, a[1]), (b[0] - d, b[1]), b)


def wires(graph: dict, schemas: dict) -> list[Wire]:
    """Every link of `graph` as the editor draws it."""
    geo = Geometry(graph, schemas)
    links = _links(graph)
    reroutes = {r["id"]: r for r in graph.get("reroutes") or []}
    by_id = {link["id"]: link for link in links}

    def ends(link: dict) -> tuple[Point, Point]:
        return (geo.output_pos(link["origin_id"], link["origin_slot"]),
                geo.input_pos(link["target_id"], link["target_slot"]))

    def chain(link: dict) -> list[dict]:
        out, rid = [], link.get("parentId")
        while rid is not None:
            out.append(reroutes[rid])
            rid = reroutes[rid].get("parentId")
        return out[::-1]

    angles: dict[int, tuple[float, float, Point]] = {}  # reroute -> cos, sin, control point

    def angle(reroute: dict, start: Point) -> tuple[float, float, Point]:
        if reroute["id"] in angles:
            return angles[reroute["id"]]
        pos = tuple(reroute["pos"])
        outgoing = []
        for link_id in reroute.get("linkIds") or []:
            link = by_id[link_id]
            path = chain(link)
            index = [r["id"] for r in path].index(reroute["id"])
            if index + 1 < len(path):
                nxt = tuple(path[index + 1]["pos"])
            elif link["target_id"] == SUBGRAPH_OUTPUT_ID:
                continue  # the editor finds no node there: this wire adds no direction
            else:
                nxt = ends(link)[1]
            outgoing.append(math.atan2(nxt[1] - pos[1], nxt[0] - pos[0]))
        if not outgoing:  # the editor's reset: no tangent, the legs meet at a point
            angles[reroute["id"]] = (0.0, 0.0, (0.0, 0.0))
            return angles[reroute["id"]]
        mean = sum(outgoing) / len(outgoing)
        arriving = math.atan2(pos[1] - start[1], pos[0] - start[0])
        diff = (arriving - mean) * 0.5
        if abs(diff) > math.pi * 0.5:
            diff += math.pi
        cos, sin = math.cos(arriving - diff), math.sin(arriving - diff)
        dist = min(REROUTE_MAX_OFFSET, math.dist(start, pos) * 0.25)
        angles[reroute["id"]] = (cos, sin, (-dist * cos, -dist * sin))
        return angles[reroute["id"]]

    out = []
    for link in sorted(links, key=lambda x: x["id"]):
        a, b = ends(link)
        path = chain(link)
        origin = (link["origin_id"], link["origin_slot"])
        keys = tuple(("reroute", r["id"]) for r in path) + (("link", link["id"]),)
        if not path:
            out.append(Wire(link["id"], origin, (_plain(a, b),), keys))
            continue
        legs = []
        previous, out_dir = a, None
        for reroute in path:
            pos = tuple(reroute["pos"])
            cos, sin, control = angle(reroute, previous)
            if out_dir is None:  # the first leg leaves the output to the right
                c1 = (previous[0] + math.dist(previous, pos) * 0.25, previous[1])
            else:
                d = min(REROUTE_MAX_OFFSET, math.dist(previous, pos) * 0.25)
                c1 = (previous[0] + d * out_dir[0], previous[1] + d * out_dir[1])
            legs.append((previous, c1, (pos[0] + control[0], pos[1] + control[1]), pos))
            previous, out_dir = pos, (cos, sin)
        d = min(REROUTE_MAX_OFFSET, math.dist(previous, b) * 0.25)
        last = math.dist(previous, b) * 0.25
        legs.append((previous, (previous[0] + d * out_dir[0], previous[1] + d * out_dir[1]),
                     (b[0] - last, b[1]), b))
        out.append(Wire(link["id"], origin, tuple(legs), keys))
    return out


def _sample(bezier: Bezier, n: int = SAMPLES) -> list[Point]:
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = bezier
    pts = []
    for i in range(n + 1):
        t = i / n
        u = 1 - t
        pts.append((u * u * u * x0 + 3 * u * u * t * x1 + 3 * u * t * t * x2 + t * t * t * x3,
                    u * u * u * y0 + 3 * u * u * t * y1 + 3 * u * t * t * y2 + t * t * t * y3))
    return pts


def polyline(wire: Wire) -> list[Point]:
    pts: list[Point] = []
    for leg in wire.legs:
        sampled = _sample(leg)
        pts += sampled if not pts else sampled[1:]
    return pts


def _segments_cross(p: Point, q: Point, r: Point, s: Point) -> bool:
    d = (q[0] - p[0]) * (s[1] - r[1]) - (q[1] - p[1]) * (s[0] - r[0])
    if abs(d) < 1e-12:
        return False
    t = ((r[0] - p[0]) * (s[1] - r[1]) - (r[1] - p[1]) * (s[0] - r[0])) / d
    v = ((r[0] - p[0]) * (q[1] - p[1]) - (r[1] - p[1]) * (q[0] - p[0])) / d
    return 0 <= t < 1 and 0 <= v < 1


def _bounds(pts: list[Point]) -> tuple[float, float, float, float]:
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return min(xs), min(ys), max(xs), max(ys)


def crossings(drawn: list[Wire]) -> list[tuple[tuple, tuple]]:
    """Pairs of drawn curves that intersect. A curve is one leg of a wire (a stretch between
    reroutes, drawn once however many links run through it); curves of one output (which
    share their start and their reroutes) are not compared."""
    legs: dict[tuple, tuple[tuple[int, int], list[Point]]] = {}
    for wire in drawn:
        keys = wire.keys or tuple(("link", wire.id) for _ in wire.legs)
        for key, leg in zip(keys, wire.legs, strict=True):
            legs.setdefault(key, (wire.origin, _sample(leg)))
    boxes = {key: _bounds(pts) for key, (_, pts) in legs.items()}
    out = []
    for a, b in combinations(sorted(legs), 2):
        (origin_a, pa), (origin_b, pb) = legs[a], legs[b]
        if origin_a == origin_b:
            continue
        ba, bb = boxes[a], boxes[b]
        if ba[0] > bb[2] or bb[0] > ba[2] or ba[1] > bb[3] or bb[1] > ba[3]:
            continue
        if any(_segments_cross(pa[i], pa[i + 1], pb[j], pb[j + 1])
               for i in range(len(pa) - 1) for j in range(len(pb) - 1)):
            out.append((a, b))
    return out


def _overlap(a, b, gap: float = 0) -> bool:
    return a[0] < b[2] + gap and b[0] < a[2] + gap and a[1] < b[3] + gap and b[1] < a[3] + gap


def group_boxes(graph: dict) -> dict[str, tuple[float, float, float, float]]:
    out = {}
    for group in graph.get("groups") or []:
        x, y, w, h = group["bounding"]
        out[group["title"]] = (x, y, x + w, y + h)
    return out


def overlaps(graph: dict, schemas: dict) -> list[tuple[str, str]]:
    """Overlapping nodes (title bars included), overlapping groups, and nodes that a group
    box cuts (neither inside nor outside it)."""
    geo = Geometry(graph, schemas)
    boxes = {n["title"] if n.get("title") else str(n["id"]): geo.box(n["id"])
             for n in graph["nodes"]}
    out = [(a, b) for a, b in combinations(boxes, 2) if _overlap(boxes[a], boxes[b])]
    groups = group_boxes(graph)
    out += [(a, b) for a, b in combinations(groups, 2) if _overlap(groups[a], groups[b])]
    for title, box in groups.items():
        for name, node in boxes.items():
            inside = (box[0] <= node[0] and node[2] <= box[2] and box[1] <= node[1]
                      and node[3] <= box[3])
            if _overlap(box, node) and not inside:
                out.append((title, name))
    return out


def leg_names(graph: dict) -> dict[tuple[str, int], str]:
    """A readable name for every drawn curve: "Seed.INT -> PASS1 Noise.noise_seed" for a
    wire's last leg, "Seed.INT lane (3)" for a stretch of a lane ending at reroute 3."""
    nodes = {n["id"]: n for n in graph["nodes"]}

    def output(node_id: int, slot: int) -> str:
        if node_id == SUBGRAPH_INPUT_ID:
            return f"input.{graph['inputs'][slot]['name']}"
        node = nodes[node_id]
        return f"{node.get('title', node['type'])}.{node['outputs'][slot]['name']}"

    def input_(node_id: int, slot: int) -> str:
        if node_id == SUBGRAPH_OUTPUT_ID:
            return f"output.{graph['outputs'][slot]['name']}"
        node = nodes[node_id]
        return f"{node.get('title', node['type'])}.{node['inputs'][slot]['name']}"

    out = {}
    links = _links(graph)
    for link in links:
        out[("link", link["id"])] = (f"{output(link['origin_id'], link['origin_slot'])} -> "
                                     f"{input_(link['target_id'], link['target_slot'])}")
    for reroute in graph.get("reroutes") or []:
        first = next(x for x in links if x["id"] in (reroute.get("linkIds") or []))
        out[("reroute", reroute["id"])] = (
            f"{output(first['origin_id'], first['origin_slot'])} lane ({reroute['id']})")
    return out
