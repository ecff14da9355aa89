"""The tests import the pack's own modules plainly: a module missing from an install (a packaging
break) fails the run instead of turning into skips. Skipping is for what is optional outside the
pack (ComfyUI, a GPU, scipy)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _names_own_module(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(".")[0] == "h3_multigpu"
    if isinstance(node, ast.JoinedStr) and node.values:  # f"h3_multigpu.{name}"
        return _names_own_module(node.values[0])
    return False


def _imports_own_module(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h3_multigpu"):
                return True
            if isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "h3_multigpu" for a in node.names):
                return True
    return False


def _calls_skip(handler: ast.ExceptHandler) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "skip" for n in ast.walk(handler))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError")
               for k in kinds)


def skipped_own_imports(source: str, filename: str = "<test>") -> list[str]:
    """Where `source` skips when a module of the pack does not import: importorskip of one,
    or `try: import ... except ImportError: pytest.skip(...)`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Call) and node.args
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "importorskip"
                and _names_own_module(node.args[0])):
            found.append(f"{filename}:{node.lineno}: importorskip of the pack's own module")
        if isinstance(node, ast.Try) and _imports_own_module(node.body) and any(
                _catches_import_error(h) and _calls_skip(h) for h in node.handlers):
            found.append(f"{filename}:{node.lineno}: skips when the pack's own module fails")
    return found


def test_no_test_skips_when_a_module_of_the_pack_fails_to_import():
    found = [hit for path in sorted(TESTS.rglob("*.py"))
             for hit in skipped_own_imports(path.read_text(encoding="utf-8"), path.name)]
    assert not found, "import the pack's modules plainly:\n" + "\n".join(found)


def test_the_check_finds_each_way_of_skipping():
    planted = '''
import pytest
chunking = pytest.importorskip("h3_multigpu.chunking")
pytest.importorskip(f"h3_multigpu.{name}")
try:
    from h3_multigpu.planner import plan_job
except ImportError as exc:
    pytest.skip(f"planner: {exc}")
scipy = pytest.importorskip("scipy")
'''
    assert sorted(hit.split(":")[1] for hit in skipped_own_imports(planted)) == ["3", "4", "5"]
