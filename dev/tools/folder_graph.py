"""The folder graph of the shipped package: which folder imports which, and whether every arrow
points down the layers of docs/architecture.md.

    python dev/tools/folder_graph.py            # the edges, then any loop or upward arrow
    python dev/tools/folder_graph.py --mermaid  # the graph as docs/architecture.md draws it

Every import counts, also one inside a function or under TYPE_CHECKING: a lazy import is still
an arrow. tests/test_layers.py runs `violations()` in the default suite.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "h3_multigpu"
# Not shipped (setup.py's DEV_PACKAGES) or data only.
NOT_PRODUCT = {"tests", "dev", "docs", "workflows", ".venv", ".carry", ".git", ".ci"}
# Bottom up. A folder may import only folders of a lower layer (never one of its own layer):
# features do not import each other, the planner reads features, nodes and client sit on top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("comfy_seam",),  # the one door into ComfyUI
    ("common",),  # geometry, devices and the device split, host memory, exactness floors
    ("exchange", "kernels"),  # shared services: GPU-to-GPU transport, attention backends
    ("chunking", "decode", "dual_sage", "guard", "offload", "sequence", "upscale"),  # features
    ("planner",),  # reads features' sizing
    ("client", "nodes"),  # what the user touches: the API client and the V3 nodes
    ("<root>",),  # the package's own modules: __init__ (ComfyUI's entry), cli, __main__
)
RANK = {folder: rank for rank, layer in enumerate(LAYERS) for folder in layer}


def _folder_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else "<root>"


def _target(path: Path, node: ast.ImportFrom | ast.Import, name: str | None) -> str | None:
    """The first folder below the package an import names (None: not the package)."""
    if isinstance(node, ast.ImportFrom) and node.level:
        parts = list(path.relative_to(ROOT).parts[:-1])
        parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
        dotted = [*parts, *(node.module.split(".") if node.module else [])]
        if not dotted and name:  # `from .. import geometry`
            dotted = [name]
    else:
        full = node.module if isinstance(node, ast.ImportFrom) else name
        dotted = (full or "").split(".")
        if dotted[0] != PACKAGE:
            return None
        dotted = dotted[1:] or ([name] if name else [])
    if not dotted:
        return None
    head = dotted[0]
    return head if (ROOT / head).is_dir() else "<root>"


def product_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PRODUCT or rel.parts[0].startswith(".") or rel.name == "setup.py":
            continue
        files.append(path)
    return files


def edges() -> dict[tuple[str, str], list[str]]:
    """{(from folder, to folder): ["file:line", ...]} over the shipped package."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in product_files():
        source = _folder_of(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names] if not node.module else [None]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = _target(path, node, name)
                if target and target != source:
                    where = f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"
                    found[(source, target)].append(where)
    return dict(found)


def violations() -> list[str]:
    """Every arrow that is not strictly downward, and every folder no layer names."""
    out = []
    graph = edges()
    for folder in {f for pair in graph for f in pair} - set(RANK):
        out.append(f"{folder}/ is in no layer of dev/tools/folder_graph.py LAYERS")
    for (source, target), where in sorted(graph.items()):
        if source in RANK and target in RANK and RANK[target] >= RANK[source]:
            kind = "sideways" if RANK[target] == RANK[source] else "upward"
            out.append(f"{source} -> {target} ({kind}): {', '.join(where)}")
    return out


def mermaid() -> str:
    lines = ["flowchart BT"]
    for rank, layer in enumerate(LAYERS):
        lines.append(f"  subgraph L{rank}[\"{' · '.join(layer)}\"]")
        lines.extend(f"    {f.strip('<>')}" for f in layer)
        lines.append("  end")
    for source, target in sorted(edges()):
        lines.append(f"  {source.strip('<>')} --> {target.strip('<>')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mermaid", action="store_true", help="print the graph as mermaid")
    args = parser.parse_args(argv)
    if args.mermaid:
        print(mermaid())
        return 0
    for (source, target), where in sorted(edges().items()):
        print(f"{source:>10} -> {target:<10} {len(where):3d} import(s)")
    bad = violations()
    print("\n".join(["", *bad]) if bad else "\nno loop, no upward or sideways arrow")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
