"""Place a subgraph's nodes in columns and run its long wires along straight reroute lanes.

A layered drawing. `subgraph_columns.py` gives the columns, left to right, and in each, top to
bottom, the nodes and the lanes passing it (`order_search.py` chose the orders with the fewest
crossings); this module measures things out. A *lane* carries the wires of one output past the
columns between it and their inputs: a straight horizontal track with a native reroute where
it starts and where wires leave it for a column. A *backward lane* carries a wire to a node
further left (the sizes and the length, which sit beside the stage that uses them, back to the
placement node): out of its output, down under the columns, and in from the left.

- x: columns left to right, each as wide as its widest node, `GAP` apart;
- y: every node and lane kept in its column's order, clear of the other boxes and of the group
  boxes it is not in, and pulled level with what it is wired to (Gauss-Seidel steps that keep
  every constraint satisfied, from the tightest stacking);
- reroutes: a lane starts in the gap after its source column and drops its wires in the gap
  before each target column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ui_graph import Node, Reroute, Subgraph, SubgraphInput, SubgraphOutput, Workflow

TITLE = 30  # the editor draws a node's title bar above its pos
GAP = 240  # between columns: room for the wires to change height
START = 0.2  # a lane starts this far (in gaps) before the column after its source
DROP = 0.7  # wires leave a lane this far (in gaps) before their column
NODE_GAP = 36  # between two nodes of one group (title bar included)
GROUP_TOP, GROUP_BOTTOM = 70, 20  # a group box around its nodes (ui_graph._group_boxes)
CLEAR = 30  # between boxes that are not in one group, and around lanes
IO_SLOT = 20  # the subgraph's input/output node: one row per slot
IO_TOP = 24  # from the IO node's top to its first slot's centre
IN, OUT = "IN", "OUT"


@dataclass(frozen=True, repr=False)
class Lane:
    """The lane of output `output` of `source` (a Node, or IN for a subgraph input)."""

    source: Any
    output: str

    def __repr__(self) -> str:
        return f"lane of {getattr(self.source, 'title', self.source)}.{self.output}"


@dataclass(frozen=True, repr=False)
class Back:
    """The lane of a wire drawn backwards: from `source` (a later column) under the columns
    between, back to its target's column, entered from the left like any input."""

    source: Any
    output: str

    def __repr__(self) -> str:
        return f"backward lane of {getattr(self.source, 'title', self.source)}.{self.output}"


@dataclass(eq=False)
class Unit:
    item: Any
    column: int
    y: float = 0.0


class Layout:
    def __init__(self, wf: Workflow, sub: Subgraph, columns: list[list[Any]],
                 io_widths: tuple[float, float] = (128, 140)):
        self.wf, self.sub = wf, sub
        self.io_widths = io_widths
        wf._assign_link_ids()  # the node entries read below name their links
        self.group_of = {id(n): g.title for g in sub.groups for n in g.members}
        self.units: dict[Any, Unit] = {}
        self.columns: list[list[Unit]] = []
        for c, column in enumerate(columns):
            row = []
            for item in column:
                key = self._key(item)
                if isinstance(item, (Lane, Back)):  # one unit: a lane keeps its height
                    unit = self.units.setdefault(key, Unit(item, c))
                else:
                    if key in self.units:
                        raise ValueError(f"{self._label(item)} is in two columns")
                    unit = self.units[key] = Unit(item, c)
                row.append(unit)
            self.columns.append(row)
        self.edges = []  # (source, output, target, input, source column, target column)
        for src, out, target, name in wf._edges(sub):
            a = self.units[self._source_key(src)].column
            b = self.units[self._target_key(target)].column
            lane = self._lane(src, out)
            if a >= b:
                lane = Back(lane.source, lane.output)
                span = range(b, a + 1)
            else:
                span = range(a + 1, b)
            missing = [c for c in span if not any(u.item == lane for u in self.columns[c])]
            if missing:
                raise ValueError(f"{lane} does not pass columns {missing}")
            self.edges.append((src, out, target, name, a, b))
        missing = [n.title for n in sub.nodes if id(n) not in self.units]
        if missing:
            raise ValueError(f"nodes in no column: {missing}")

    # ------------------------------------------------------------------ items
    @staticmethod
    def _key(item: Any) -> Any:
        return item if isinstance(item, (str, Lane, Back)) else id(item)

    @staticmethod
    def _source_key(src: Any) -> Any:
        return IN if isinstance(src, SubgraphInput) else id(src)

    @staticmethod
    def _target_key(target: Any) -> Any:
        return OUT if isinstance(target, SubgraphOutput) else id(target)

    @staticmethod
    def _label(item: Any) -> str:
        if isinstance(item, str):
            return item
        return getattr(item, "title", None) or getattr(item, "name", None) or str(item)

    @staticmethod
    def _lane(src: Any, out: str) -> Lane:
        return Lane(IN, src.name) if isinstance(src, SubgraphInput) else Lane(src, out)

    def _group(self, unit: Unit) -> str | None:
        return self.group_of.get(id(unit.item))

    def _extent(self, unit: Unit, padded: bool) -> tuple[float, float]:
        """(above pos, below pos) of the unit's box; `padded` adds its group box's margins."""
        item = unit.item
        if isinstance(item, (Lane, Back)):
            return (0.0, 0.0)
        if item == IN:
            return (0.0, IO_TOP + IO_SLOT * len(self.sub.inputs))
        if item == OUT:
            return (0.0, IO_TOP + IO_SLOT * len(self.sub.outputs))
        top, bottom = TITLE, self.wf._size(item)[1]
        if padded and self._group(unit):
            top, bottom = GROUP_TOP, bottom + GROUP_BOTTOM
        return (top, bottom)

    def _width(self, unit: Unit) -> float:
        if unit.item == IN:
            return self.io_widths[0]
        if unit.item == OUT:
            return self.io_widths[1]
        if isinstance(unit.item, (Lane, Back)):
            return 0.0
        return self.wf._size(unit.item)[0]

    def _out_dy(self, src: Any, out: str) -> float:
        if isinstance(src, SubgraphInput):
            return IO_TOP + IO_SLOT * src.index
        return IO_SLOT * (self.wf.output_index(src, out) + 0.7)

    def _in_dy(self, target: Any, name: str) -> float:
        if isinstance(target, SubgraphOutput):
            return IO_TOP + IO_SLOT * target.index
        slots = self.wf.slots(target)
        slot = next(s for s in slots if s.name == name)
        if not slot.widget:
            return IO_SLOT * ([s.name for s in slots if not s.widget].index(name) + 0.7)
        import wire_geometry as wires

        return wires._widget_rows(self.wf._ui_node(target, True),
                                  self.wf.schemas)[name] + IO_SLOT / 2

    # ------------------------------------------------------------------ heights
    def _constraints(self) -> list[tuple[Unit, Unit, float]]:
        """(upper, lower, least distance between their y) for every pair that must keep its
        order: neighbours in a column, and anything in a column with a group's nodes against
        every node of that group (a lane that feeds or leaves the group may run inside it)."""
        out = []
        for column in self.columns:
            for upper, lower in zip(column, column[1:], strict=False):
                out.append((upper, lower, self._separation(upper, lower)))
        members: dict[str, list[Unit]] = {}
        for unit in self.units.values():
            if not isinstance(unit.item, (Lane, Back)) and self._group(unit):
                members.setdefault(self._group(unit), []).append(unit)
        touches: dict[Any, set[str]] = {}  # lane -> the groups it leaves or enters
        for src, output, target, _name, a, b in self.edges:
            lane = self._lane(src, output)
            if b <= a:
                lane = Back(lane.source, lane.output)
            for node in (src, target):
                if id(node) in self.group_of:
                    touches.setdefault(lane, set()).add(self.group_of[id(node)])
        for column in self.columns:
            for g, nodes in members.items():
                block = [i for i, u in enumerate(column) if self._group(u) == g]
                if not block:
                    continue
                for i, unit in enumerate(column):
                    if self._group(unit) == g or g in touches.get(unit.item, ()):
                        continue
                    for node in nodes:
                        if i < block[0]:
                            out.append((unit, node, self._separation(unit, node)))
                        elif i > block[-1]:
                            out.append((node, unit, self._separation(node, unit)))
        return out

    def _separation(self, upper: Unit, lower: Unit) -> float:
        same = self._group(upper) is not None and self._group(upper) == self._group(lower)
        _, below = self._extent(upper, not same)
        above, _ = self._extent(lower, not same)
        return below + above + (NODE_GAP if same else CLEAR)

    def _pulls(self) -> dict[int, list[tuple[Unit, float]]]:
        """unit -> (unit it is wired to, offset it wants from that unit's y)."""
        pulls: dict[int, list[tuple[Unit, float]]] = {}
        seen = set()
        for src, out, target, name, a, b in self.edges:
            left = self.units[self._source_key(src)]
            right = self.units[self._target_key(target)]
            lo, ro = self._out_dy(src, out), self._in_dy(target, name)
            if b <= a:
                continue  # a backward lane keeps to the bottom
            if b > a + 1:
                lane = self.units[self._lane(src, out)]
                hops = [(left, lo, lane, 0.0), (lane, 0.0, right, ro)]
            else:
                hops = [(left, lo, right, ro)]
            for u, uo, v, vo in hops:
                if (id(u), uo, id(v), vo) not in seen:
                    seen.add((id(u), uo, id(v), vo))
                    pulls.setdefault(id(v), []).append((u, uo - vo))
                    pulls.setdefault(id(u), []).append((v, vo - uo))
        return pulls

    def place(self, iterations: int = 300) -> None:
        units = list(self.units.values())
        pairs = self._constraints()
        above: dict[int, list[tuple[Unit, float]]] = {}
        below: dict[int, list[tuple[Unit, float]]] = {}
        for upper, lower, sep in pairs:
            above.setdefault(id(lower), []).append((upper, sep))
            below.setdefault(id(upper), []).append((lower, sep))
        for unit in units:
            unit.y = 0.0
        for _ in range(len(units) + 1):  # tightest stacking: longest paths from the top
            moved = False
            for unit in units:
                low = max((u.y + s for u, s in above.get(id(unit), [])), default=0.0)
                if low > unit.y + 1e-6:
                    unit.y, moved = low, True
            if not moved:
                break
        else:
            cycle = [self._label(u.item) if not isinstance(u.item, (Lane, Back)) else
                     repr(u.item) for u in units
                     if max((a.y + s for a, s in above.get(id(u), [])), default=0) > u.y]
            raise ValueError(f"the column orders contradict each other around {cycle}")
        pulls = self._pulls()
        for _ in range(iterations):
            for unit in units:
                wanted = pulls.get(id(unit))
                if not wanted:
                    continue
                target = sum(u.y + d for u, d in wanted) / len(wanted)
                low = max((u.y + s for u, s in above.get(id(unit), [])), default=-1e9)
                high = min((u.y - s for u, s in below.get(id(unit), [])), default=1e9)
                unit.y = min(max(target, low), high)
        top = min(u.y - self._extent(u, True)[0] for u in units)
        for unit in units:
            unit.y = round(unit.y - top)

    # ------------------------------------------------------------------ output
    def _xs(self) -> tuple[list[float], list[float]]:
        xs, widths, x = [], [], 0.0
        for column in self.columns:
            width = max(self._width(u) for u in column)
            xs.append(x)
            widths.append(width)
            x += width + GAP
        return xs, widths

    def apply(self) -> None:
        """Place everything and write positions, IO boxes and reroutes into the subgraph."""
        self.place()
        xs, widths = self._xs()
        for c, column in enumerate(self.columns):
            for unit in column:
                if unit.item == IN:
                    self.sub.input_pos = (xs[c] + widths[c] - self.io_widths[0], unit.y)
                    self.sub.input_width = self.io_widths[0]
                elif unit.item == OUT:
                    self.sub.output_pos = (xs[c], unit.y)
                elif isinstance(unit.item, Node):
                    unit.item.pos = (round(xs[c]), unit.y)
        drops: dict[Lane, dict[int, list[tuple[Any, str]]]] = {}
        starts: dict[Lane, int] = {}
        for src, out, target, name, a, b in self.edges:
            if b <= a:
                lane = self._lane(src, out)
                y = self.units[Back(lane.source, lane.output)].y
                turn = self.sub.reroute((xs[a] + widths[a] + GAP * 0.4, y))
                back = self.sub.reroute((xs[b] - GAP * 0.6, y), turn)
                self.sub.route(target, name, back)
            elif b > a + 1:
                lane = self._lane(src, out)
                starts[lane] = a + 1
                drops.setdefault(lane, {}).setdefault(b, []).append((target, name))
        for lane, by_column in drops.items():
            y = self.units[lane].y
            point: Reroute = self.sub.reroute((xs[starts[lane]] - GAP * START, y))
            for c in sorted(by_column):
                point = self.sub.reroute((xs[c] - GAP * DROP, y), point)
                for target, name in by_column[c]:
                    self.sub.route(target, name, point)


def columns_of(sub: Subgraph, spec: list[list[str]]) -> list[list[Any]]:
    """The notation of `subgraph_columns.py` as layout items: a title is that node, IN / OUT
    the subgraph's input / output node, '~Title.output' that output's lane, '<Title.output'
    its backward lane ('~IN.name' for the subgraph input `name`)."""
    nodes = {n.title: n for n in sub.nodes}
    out = []
    for column in spec:
        items = []
        for entry in column:
            if entry in (IN, OUT):
                items.append(entry)
            elif entry[0] in "~<":
                title, output = entry[1:].rsplit(".", 1)
                source = IN if title == IN else nodes[title]
                items.append((Lane if entry[0] == "~" else Back)(source, output))
            else:
                items.append(nodes[entry])
        out.append(items)
    return out
