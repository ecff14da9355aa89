"""Find the column orders of the bundled workflows' subgraphs with the fewest crossing wires.

    python dev/workflow_layout/order_search.py # rewrites subgraph_columns.py (scipy)

A design tool, not part of the build: `build_workflows.py` reads the orders from
`subgraph_columns.py`, so the files stay reproducible without scipy. The model is a layered
drawing: every node sits in the column `COLUMN` gives it; a wire that skips columns runs on a
lane, one per output (the wires of one output share it), that keeps its height; a group's nodes
stay together in each column and a lane passes a group it does not serve on one side. The
number of crossings between neighbouring columns is then a function of the orders alone, and an
integer program (scipy's HiGHS) finds the orders with the fewest, exactly: under these rules no
drawing of these columns has fewer. Where orders tie, a small price per
pair breaks the tie towards the reading order of `PREFERRED`.

The sizes and the length are the exception: each sits beside the node that uses it (PASS1 size
and length before the conditioning, PASS2 size before the upscale) and its wire to the
placement node runs back under everything on a lane of its own ('<' in the columns). Those
wires are left out of the program (nothing lies below them) and added at the bottom.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PLACEMENT = "Multi-GPU Placement"
COLUMN = {  # title -> column (IN / OUT: the subgraph's input and output nodes)
    "Diffusion Model": 0,
    "Turbo LoRA": 1, "Text Encoder": 1, "Video VAE": 1, "Audio VAE": 1, "Latent Upscaler": 1,
    PLACEMENT: 2, "IN": 3,
    "Prompt": 4, "PASS1 Width": 4, "PASS1 Height": 4, "Seconds": 4,
    "PASS1 Conditioning": 5, "Release Text Encoder": 6, "Seed": 6, "PASS1 Steps": 6,
    "PASS1 Noise": 7, "Guider": 7, "Sampler": 7, "PASS1 Schedule": 7,
    "PASS1 Sampler": 8, "PASS2 Width": 8, "PASS2 Height": 8,
    "Latent Upscale": 9, "PASS2 Steps": 9,
    "PASS2 Noise": 10, "PASS2 Schedule": 10, "PASS2 Sampler": 11,
    "Decode Video": 12, "Decode Audio": 12, "Create Video": 13, "OUT": 14,
}
I2V_COLUMN = {"PASS2 Keyframes": 10, "PASS2 Noise": 11, "PASS2 Guider": 11, "PASS2 Schedule": 11,
              "PASS2 Sampler": 12, "Decode Video": 13, "Decode Audio": 13, "Create Video": 14,
              "OUT": 15}
FIXED = [("Turbo LoRA", "Text Encoder", "Video VAE", "Audio VAE", "Latent Upscaler")]
PREFERRED = [("Seed", "PASS1 Steps"), ("PASS1 Noise", "Guider", "Sampler", "PASS1 Schedule"),
             ("PASS2 Noise", "PASS2 Guider", "PASS2 Schedule"), ("Decode Video", "Decode Audio"),
             ("Prompt", "PASS1 Width", "PASS1 Height", "Seconds"),
             ("PASS2 Width", "PASS2 Height")]
BACKWARDS = [("Seconds", "seconds"), ("PASS1 Height", "INT"), ("PASS1 Width", "INT"),
             ("PASS2 Height", "INT"), ("PASS2 Width", "INT")]  # innermost first


def wiring(kind: str) -> tuple[dict, list, dict]:
    """(ports, wires, groups) of the kind's subgraph by title: ports[title] = (inputs,
    outputs); wires = (source, output index, target, input index); groups[title] = group."""
    import build_workflows
    from ui_graph import SubgraphInput, SubgraphOutput

    build_workflows.COLUMNS = None  # the wiring only: no positions (the orders may be stale)
    wf = build_workflows.two_pass(kind)
    sub = wf.subgraphs[0]
    ports = {"IN": ([], [i.name for i in sub.inputs]), "OUT": ([o.name for o in sub.outputs], [])}
    for node in sub.nodes:
        ports[node.title] = ([s.name for s in wf.slots(node)],
                             [name for name, _ in wf.outputs(node)])
    wires = []
    for src, out, target, name in wf._edges(sub):
        source = "IN" if isinstance(src, SubgraphInput) else src.title
        index = ports[source][1].index(src.name if source == "IN" else out)
        dest = "OUT" if isinstance(target, SubgraphOutput) else target.title
        wires.append((source, index, dest, ports[dest][0].index(name)))
    groups = {n.title: g.title for g in sub.groups for n in g.members}
    return ports, wires, groups


def search(kind: str, time_limit: float = 300) -> tuple[int, list[list[str]]]:
    """The fewest crossings and the column orders (lanes as '~Title.output')."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    ports, wires, group_of = wiring(kind)
    column = dict(COLUMN, **(I2V_COLUMN if kind == "i2v" else {}))
    backwards = {(s, ports[s][1].index(o)) for s, o in BACKWARDS}
    wires = [w for w in wires if (w[0], w[1]) not in backwards]
    layers: list[list[str]] = [[] for _ in range(max(column.values()) + 1)]
    for title in ports:
        layers[column[title]].append(title)
    lane_of: dict[str, tuple[tuple[str, int], int]] = {}
    segments = set()  # (column, (unit, port), (unit, port), origin)
    for source, out, target, into in wires:
        a, b = column[source], column[target]
        assert a < b, (source, target)
        previous = (source, out)
        for c in range(a + 1, b):
            lane = f"~{source}.{ports[source][1][out]}@{c}"
            if lane not in lane_of:
                layers[c].append(lane)
                lane_of[lane] = ((source, out), c)
            segments.add((c - 1, previous, (lane, 0), (source, out)))
            previous = (lane, 0)
        segments.add((b - 1, previous, (target, into), (source, out)))

    touches: dict[tuple[str, int], set] = {}  # an output's lane may run inside these groups
    for source, out, target, _ in wires:
        touches.setdefault((source, out), set()).update(
            {group_of.get(source), group_of.get(target)} - {None})
    spans: dict[str, list[int]] = {}
    for title, group in group_of.items():
        spans.setdefault(group, []).append(column[title])
    for group, cols in spans.items():  # a group's box covers every column it spans
        for c in range(min(cols), max(cols) + 1):
            if c not in cols:
                wall = f"#{group}@{c}"
                layers[c].append(wall)
                group_of[wall] = group
    index, variables, rows = {}, {}, []

    def var(key) -> int:
        return variables.setdefault(key, len(variables))

    for c, layer in enumerate(layers):
        for i, unit in enumerate(layer):
            index[unit] = (c, i)

    def above(a: str, b: str) -> tuple[dict, int]:
        """'a above b' as ({variable: coefficient}, constant)."""
        if index[a][1] < index[b][1]:
            return {var(("o", a, b)): 1}, 0
        return {var(("o", b, a)): -1}, 1

    def add(terms, low, high) -> None:
        expr, const = {}, 0
        for sign, (coeffs, k) in terms:
            for v, coeff in coeffs.items():
                expr[v] = expr.get(v, 0) + sign * coeff
            const += sign * k
        rows.append((expr, low - const, high - const))

    for layer in layers:
        for a, b, c in itertools.combinations(layer, 3):  # a total order per column
            add([(1, above(a, b)), (1, above(b, c)), (-1, above(a, c))], 0, 1)
        for group in {group_of.get(u) for u in layer} - {None}:
            members = [u for u in layer if group_of.get(u) == group]
            for a, b in itertools.combinations(members, 2):
                for other in (u for u in layer if group_of.get(u) != group
                              and group not in touches.get(lane_of.get(u, (None,))[0], ())):
                    add([(1, above(a, other)), (1, above(other, b))], -np.inf, 1)
                    add([(1, above(b, other)), (1, above(other, a))], -np.inf, 1)
    for lane, (_, c) in lane_of.items():  # a lane keeps its height: no swaps
        following = lane.rsplit("@", 1)[0] + f"@{c + 1}"
        if following not in lane_of:
            continue
        for other, (_, c2) in lane_of.items():
            nxt = other.rsplit("@", 1)[0] + f"@{c + 1}"
            if c2 == c and other != lane and nxt in lane_of:
                add([(1, above(lane, other)), (-1, above(following, nxt))], 0, 0)
    def member(group: str, c: int) -> str | None:
        return next((u for u in layers[c] if group_of.get(u) == group), None)

    for lane, (_, c) in lane_of.items():  # a lane passes a group on one side only
        following = lane.rsplit("@", 1)[0] + f"@{c + 1}"
        for group in spans:
            if group in touches[lane_of[lane][0]]:
                continue
            a, b = member(group, c), member(group, c + 1) if c + 1 < len(layers) else None
            if following in lane_of and a and b:
                add([(1, above(lane, a)), (-1, above(following, b))], 0, 0)
    for g, h in itertools.combinations(spans, 2):  # and groups keep their order
        shared = [c for c in range(len(layers)) if member(g, c) and member(h, c)]
        for c1, c2 in itertools.pairwise(shared):
            add([(1, above(member(g, c1), member(h, c1))),
                 (-1, above(member(g, c2), member(h, c2)))], 0, 0)
    for chain in FIXED:
        for a, b in itertools.pairwise(chain):
            add([(1, above(a, b))], 1, 1)
    for title, _ in BACKWARDS:  # their backward lanes pass under them: nothing below
        for other in layers[column[title]]:
            if other not in dict(BACKWARDS) and other != title:
                add([(1, above(other, title))], 1, 1)

    crossing_vars, fixed = [], 0
    by_column: dict[int, list] = {}
    for c, a, b, origin in sorted(segments):
        by_column.setdefault(c, []).append((a, b, origin))
    for c, hops in by_column.items():
        for (a1, b1, o1), (a2, b2, o2) in itertools.combinations(hops, 2):
            if o1 == o2 or a1 == a2 or b1 == b2:
                continue
            left = ({}, int(a1[1] < a2[1])) if a1[0] == a2[0] else above(a1[0], a2[0])
            right = ({}, int(b1[1] < b2[1])) if b1[0] == b2[0] else above(b1[0], b2[0])
            if not left[0] and not right[0]:
                fixed += left[1] != right[1]
                continue
            x = var(("x", c, a1, b1, a2, b2))
            crossing_vars.append(x)
            add([(1, ({x: 1}, 0)), (-1, left), (1, right)], 0, np.inf)
            add([(1, ({x: 1}, 0)), (1, left), (-1, right)], 0, np.inf)
    cost = np.zeros(len(variables))
    for x in crossing_vars:
        cost[x] = 1
    for chain in PREFERRED:
        for a, b in itertools.combinations(chain, 2):
            if a in index and b in index and index[a][0] == index[b][0]:
                coeffs, _ = above(b, a)
                for v, coeff in coeffs.items():
                    cost[v] += 0.01 * coeff
    matrix = lil_matrix((len(rows), len(variables)))
    low, high = np.empty(len(rows)), np.empty(len(rows))
    for r, (expr, lo, hi) in enumerate(rows):
        for v, coeff in expr.items():
            matrix[r, v] = coeff
        low[r], high[r] = lo, hi
    result = milp(cost, constraints=LinearConstraint(matrix.tocsr(), low, high),
                  integrality=np.ones(len(variables)), bounds=Bounds(0, 1),
                  options={"time_limit": time_limit})
    if result.x is None:
        raise RuntimeError(f"{kind}: {result.message}")

    def is_above(a: str, b: str) -> bool:
        coeffs, k = above(a, b)
        return round(sum(c * result.x[v] for v, c in coeffs.items()) + k) == 1

    columns = [sorted(layer, key=lambda u, layer=layer: -sum(is_above(u, w) for w in layer
                                                             if w != u))
               for layer in layers]
    crossings = fixed + sum(round(result.x[x]) for x in crossing_vars)
    columns = [[u.rsplit("@", 1)[0] for u in col if not u.startswith("#")] for col in columns]
    placement = column[PLACEMENT]
    for title, output in BACKWARDS:
        for c in range(placement, column[title] + 1):
            columns[c].append(f"<{title}.{output}")
    return crossings, columns


def wrapped(column: list[str], width: int = 99) -> list[str]:
    """One column as a Python list literal, wrapped for ruff's line length."""
    out, line = [], "        ["
    for item in column:
        text = f'"{item}", '
        if len(line) + len(text) > width:
            out.append(line.rstrip())
            line = "         "
        line += text
    out.append(line.rstrip().rstrip(",") + "],")
    return out


def main() -> None:
    lines = ['"""Column orders of the bundled subgraphs (top to bottom), written by',
             "`order_search.py`: a node title, IN / OUT (the subgraph's input and output node),",
             "'~Title.output' the lane of that output passing the column, '<Title.output' its",
             'wire running back under the column to the placement node. LAYERED: the fewest',
             "crossings any drawing of these columns has when wires run left to right, a lane",
             'keeps one height and a group its nodes together (the backward wires aside)."""',
             ""]
    found = {}
    for kind in ("t2v", "i2v", "r2v"):
        found[kind] = search(kind)
        print(f"{kind}: {found[kind][0]} crossings between neighbouring columns")
    lines.append("LAYERED = {" + ", ".join(f'"{k}": {v[0]}' for k, v in found.items()) + "}")
    lines += ["", "COLUMNS = {"]
    for kind, (_, columns) in found.items():
        lines.append(f'    "{kind}": [')
        for col in columns:
            lines += wrapped(col)
        lines.append("    ],")
    lines.append("}")
    (HERE / "subgraph_columns.py").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
