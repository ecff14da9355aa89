"""The folders' imports point down the layers (docs/architecture.md): no loop, no arrow up or
sideways. `dev/tools/folder_graph.py` draws the graph and names the layers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "dev" / "tools" / "folder_graph.py"


@pytest.fixture(scope="module")
def folder_graph():
    spec = importlib.util.spec_from_file_location("folder_graph", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arrow_points_down_the_layers(folder_graph):
    assert folder_graph.violations() == []


def test_every_shipped_folder_is_in_a_layer(folder_graph):
    shipped = {folder_graph._folder_of(p) for p in folder_graph.product_files()}
    assert shipped - set(folder_graph.RANK) == set()
    assert "tests" not in shipped and "dev" not in shipped


def test_the_graph_sees_a_sideways_and_an_upward_arrow(folder_graph, tmp_path, monkeypatch):
    """The check can fail: a feature importing another feature, and the seam importing a
    feature, are reported."""
    root = tmp_path / "pack"
    for folder, text in {"comfy_seam": "from ..sequence import x\n",
                         "sequence": "from ..chunking import sizing\n",
                         "chunking": "from ..common import geometry\n", "common": ""}.items():
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
        (root / folder / "mod.py").write_text(text)
    monkeypatch.setattr(folder_graph, "ROOT", root)
    found = folder_graph.violations()
    assert any(v.startswith("comfy_seam -> sequence (upward)") for v in found), found
    assert any(v.startswith("sequence -> chunking (sideways)") for v in found), found
    assert not any(v.startswith("chunking -> common") for v in found), found
