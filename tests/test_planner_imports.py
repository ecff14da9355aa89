"""The planner reads features only through their torch-free sizing: planner/ imports
`<feature>.sizing` modules, `common`, the seam (`comfy_seam`, the one door into ComfyUI) and
itself, nothing else of the pack."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[1] / "planner"
ALLOWED_ROOTS = ("common", "comfy_seam")


def foreign_imports(source: str, filename: str = "<planner>") -> list[str]:
    """The imports of a planner module that reach past a feature's sizing."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            continue  # planner's own modules
        if isinstance(node, ast.ImportFrom) and node.level == 2:
            module = node.module or ""
            targets = [f"{module}.{a.name}" if module else a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h3_multigpu"):
            module = node.module.removeprefix("h3_multigpu").lstrip(".")
            targets = [f"{module}.{a.name}" if module else a.name for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.removeprefix("h3_multigpu.") for a in node.names
                       if a.name.startswith("h3_multigpu.")]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] in ALLOWED_ROOTS:
                continue
            # `from ..chunking import sizing` or `from ..chunking.sizing import X`
            if len(parts) >= 2 and parts[1] == "sizing":
                continue
            found.append(f"{filename}:{node.lineno}: {target}")
    return found


def test_the_planner_imports_only_sizing_common_and_the_seam():
    found = [hit for path in sorted(PLANNER.glob("*.py"))
             for hit in foreign_imports(path.read_text(encoding="utf-8"), path.name)]
    assert not found, "the planner reaches past a feature's sizing:\n" + "\n".join(found)


def test_the_check_finds_a_features_other_modules():
    planted = '''
from ..decode.windows import WindowLayout
from ..chunking import wrappers
from h3_multigpu.sequence.apply import apply_sequence_parallel
import h3_multigpu.offload.streamer
from ..chunking import sizing as block_sizing
from ..decode.sizing import WindowLayout
from ..common import geometry
from ..comfy_seam import h3
from .memory import BlockDims
'''
    assert [hit.split(":")[1] for hit in foreign_imports(planted)] == ["2", "3", "4", "5"]
