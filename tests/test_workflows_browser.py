"""The bundled workflows in the real ComfyUI frontend in headless Chromium.

A real ComfyUI (COMFYUI_PATH) runs with this pack, placeholder model files and a frontend
package's static files (`--front-end-root`); `tests/browser/load_workflows.mjs` loads each UI
workflow with `app.loadGraphData` (what a drag-drop does) and the editor's workflow validator
(`Comfy.Validation.Workflows`) on, and reports what the editor built.

    COMFYUI_PATH=/path/to/ComfyUI H3_BROWSER_MODULES=/path/to/node_modules \\
        python -m pytest -q -m browser -o addopts="--strict-markers" tests/test_workflows_browser.py

Any frontend: links land on the intended inputs by name, each widget shows the value the
server's schema puts there, and the editor queues exactly what `h3-multigpu submit` converts
the file to with that server's /object_info (the bundled API twin when the server serves the
schemas the files were built from). With frontend 1.58.1 on such a server the drawn wires, node
sizes and screenshots are checked too. 0.33.0 ships frontend 1.49.6.

Needs node (18+), the npm package puppeteer-core and a Chromium: H3_CHROMIUM=/usr/bin/chromium
(`apt-get install chromium`) or the npm package @sparticuz/chromium, in $H3_BROWSER_MODULES
(default ~/.cache/h3-multigpu/browser/node_modules; installed there with npm when missing). The
frontend is the installed `comfyui-frontend-package`, or the one under H3_FRONTEND_SITE (a
folder holding that package, e.g. `pip install --target DIR comfyui-frontend-package==1.58.1`).
H3_SCREENSHOTS=docs/images writes the pictures the README and docs/workflows.md show.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from comfyui_harness import start_comfyui
from workflow_bed import BUILT_FROM, built_schemas, make_bed, schema_differences, served_release

from h3_multigpu.client import editor, ui_to_api
from h3_multigpu.client.validate import check_prompt

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
LAYOUT = ROOT / "dev" / "workflow_layout"  # the layout engine that writes WORKFLOWS
SCRIPT = Path(__file__).resolve().parent / "browser" / "load_workflows.mjs"
NAMES = ("h3_multigpu_two_pass_t2v", "h3_multigpu_two_pass_i2v", "h3_multigpu_two_pass_r2v")
FRONTEND_VERSION = "1.58.1"
NPM_PACKAGES = ("@sparticuz/chromium@147", "puppeteer-core@24")
DEFAULT_MODULES = Path.home() / ".cache" / "h3-multigpu" / "browser" / "node_modules"


def browser_modules() -> Path:
    """The node_modules holding puppeteer-core (and Chromium unless H3_CHROMIUM names one);
    npm installs them when missing."""
    modules = Path(os.environ.get("H3_BROWSER_MODULES") or DEFAULT_MODULES)
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    chromium = os.environ.get("H3_CHROMIUM")
    if chromium and not Path(chromium).is_file():
        pytest.skip(f"H3_CHROMIUM={chromium} does not exist")
    packages = NPM_PACKAGES[1:] if chromium else NPM_PACKAGES
    wanted = [modules / "puppeteer-core"] + ([] if chromium else [modules / "@sparticuz" /
                                                                    "chromium"])
    if not all(p.is_dir() for p in wanted):
        if not shutil.which("npm"):
            pytest.skip(f"npm is missing and {modules} lacks {', '.join(packages)}")
        modules.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(modules.parent), *packages],
                       check=True, timeout=600, capture_output=True)
    return modules


def frontend_static() -> tuple[Path, str]:
    """(the frontend's static folder, its version)."""
    import importlib.metadata

    site = os.environ.get("H3_FRONTEND_SITE")
    if site:
        found = sorted(Path(site).glob("comfyui_frontend_package-*.dist-info"))
        if not found:
            pytest.skip(f"H3_FRONTEND_SITE={site} holds no comfyui-frontend-package")
        version = importlib.metadata.Distribution.at(found[-1]).version
        return Path(site) / "comfyui_frontend_package" / "static", version
    try:
        import comfyui_frontend_package
    except ImportError:
        pytest.skip(f"pip install comfyui-frontend-package=={FRONTEND_VERSION}")
    version = importlib.metadata.version("comfyui-frontend-package")
    return Path(comfyui_frontend_package.__file__).resolve().parent / "static", version


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """({name: what the frontend made of the workflow}, the screenshots' folder, the served
    /object_info, the frontend's version)."""
    modules = browser_modules()
    static, version = frontend_static()
    work = tmp_path_factory.mktemp("browser")
    shots = Path(os.environ.get("H3_SCREENSHOTS") or work / "shots").resolve()
    shots.mkdir(parents=True, exist_ok=True)
    job = work / "job.json"
    job.write_text(json.dumps({
        "workflows": {name: str(WORKFLOWS / f"{name}.json") for name in NAMES},
        "screenshots": str(shots)}))
    extra = ("--front-end-root", str(static), *make_bed(work / "bed"))
    with start_comfyui(os.environ["COMFYUI_PATH"], extra_args=extra) as url:
        with urllib.request.urlopen(url + "/object_info", timeout=60) as response:
            served = json.load(response)
        run = subprocess.run(["node", str(SCRIPT), url, str(job)], capture_output=True,
                             text=True, timeout=900, env={**os.environ, "NODE_PATH": str(modules)})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout), shots, served, version


def _built_for(loaded) -> bool:
    """Frontend 1.58.1 on a server serving the schemas the files were built from: the drawn
    geometry was modelled for exactly that."""
    _, _, served, version = loaded
    return version == FRONTEND_VERSION and schema_differences(served, built_schemas()) == []


def _ui(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def _graph_by_label(ui: dict) -> dict[str, dict]:
    return {"root": ui, **{sub["id"]: sub for sub in ui["definitions"]["subgraphs"]}}


@pytest.mark.parametrize("name", NAMES)
def test_the_validator_is_on_and_silent(loaded, name):
    result = loaded[0][name]
    assert result["validation_setting"] is True
    assert result["toasts"] == [], result["toasts"]
    assert result["errors"] == [], result["errors"]
    assert result["missing"] == [], f"node types the frontend does not know: {result['missing']}"


@pytest.mark.parametrize("name", NAMES)
def test_every_link_is_attached_to_the_intended_input_by_name(loaded, name):
    result, ui = loaded[0][name], _ui(name)
    graphs = _graph_by_label(ui)
    expected = {}
    for label, graph in graphs.items():
        nodes = {n["id"]: n for n in graph["nodes"]}
        for link in graph["links"]:
            if isinstance(link, list):
                link_id, origin, origin_slot, target, target_slot = link[:5]
            else:
                link_id, origin, origin_slot, target, target_slot = (
                    link["id"], link["origin_id"], link["origin_slot"], link["target_id"],
                    link["target_slot"])
            name_in = (nodes[target]["inputs"][target_slot]["name"] if target != -20
                       else f"output:{target_slot}")
            expected[(label, link_id)] = (origin, origin_slot, target, name_in)
    seen = {}
    for link in result["links"]:
        key = (link["graph"], link["id"])
        origin, target = int(link["origin_id"]), int(link["target_id"])  # -10/-20 come as text
        seen[key] = (origin, link["origin_slot"], target, link["input"])
        if target != -20:
            assert link["input_link"] == link["id"], link
    assert seen == expected


def expected_widgets(node: dict, info: dict) -> list[list]:
    """[name, value] of each widget the editor gives `node` under the served schema `info`,
    filled from its saved widgets_values by position, as the editor restores them (frontend
    1.49.6 and 1.58.1: LGraphNode.configure, unless the experimental "restore widget values by
    name" setting is on). A schema with fewer widgets takes the first values; one with more
    gives the rest their defaults."""
    stored = list(node.get("widgets_values") or [])
    layout = editor.widgets(info, editor.widget_values_by_input(info, stored))
    out = []
    for index, widget in enumerate(layout):
        value = stored[index] if index < len(stored) else editor.default_value(
            widget.kind, widget.options)
        out.append([widget.name, value])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_each_widget_value_is_on_its_widget(loaded, name):
    result, ui = loaded[0][name], _ui(name)
    served = loaded[2]
    for label, graph in _graph_by_label(ui).items():
        for node in graph["nodes"]:
            shown = result["widgets"][f"{label}/{node['id']}"]
            if node["type"] == "MarkdownNote":
                assert [value for _, value in shown] == node["widgets_values"]
                continue
            if node["type"] in served:
                # the control widget's name is the editor's own (1.49.6 on 0.33.0 names it
                # after its value); it feeds no input
                want = expected_widgets(node, served[node["type"]])
                assert len(shown) == len(want), (label, node["title"], shown, want)
                for (got_name, got), (name_, value) in zip(shown, want, strict=True):
                    assert got == value, (label, node["title"], name_)
                    if name_ not in (editor.CONTROL_WIDGET, editor.UPLOAD_WIDGET):
                        assert got_name == name_, (label, node["title"])
            if _built_for(loaded):
                want = [list(item) for item in (node.get("widgets_values_named") or {}).items()]
                assert shown == want, (label, node["title"])


@pytest.mark.parametrize("name", NAMES)
def test_graph_to_prompt_is_what_submit_converts_the_file_to(loaded, name):
    """The editor queues what the client's conversion gives with this server's /object_info,
    and that graph validates; on a server with the schemas the files were built from it is the
    bundled API twin."""
    served, version = loaded[2], loaded[3]
    prompt = loaded[0][name]["prompt"]
    converted = ui_to_api(_ui(name), served)
    if version != FRONTEND_VERSION:  # the node pack's id in _meta is 1.58's (ignored by servers)
        for node in converted.values():
            node["_meta"].pop("cnr_id", None)
    assert prompt == converted
    assert check_prompt(prompt, served) == []
    if schema_differences(served, built_schemas()) == []:
        assert prompt == json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_saving_again_keeps_every_input_link_and_value(loaded, name):
    """The editor's own save of the loaded graph has the same links (by input name) and the
    widget values the served schema puts on its widgets; on a server with the schemas the files
    were built from, the same input slots and the file's widget values. Free Autogrow slots may
    differ: 1.58.1 grows an Autogrow group while it restores links (it does the same to the
    official r2v template)."""
    saved, ui = loaded[0][name]["serialized"], _ui(name)
    served, built = loaded[2], _built_for(loaded)

    def essence(graph: dict, mine: bool) -> dict:
        nodes, slot_names = {}, {}
        for node in graph["nodes"]:
            inputs = node.get("inputs") or []
            slot_names[node["id"]] = [s["name"] for s in inputs]
            values = node.get("widgets_values") or []
            if mine and not built and node["type"] in served:
                values = [v for _, v in expected_widgets(node, served[node["type"]])]
            kept = [(s["name"], s.get("link")) for s in inputs
                    if s.get("link") is not None or built and (
                        "." not in s["name"] or "." in s["name"] and s.get("widget"))]
            nodes[node["id"]] = (kept, [s.get("links") or [] for s in node.get("outputs") or []],
                                 values)
        links = set()
        for x in graph["links"]:
            link_id, origin, origin_slot, target, target_slot, kind = (
                x[:6] if isinstance(x, list) else (x["id"], x["origin_id"], x["origin_slot"],
                                                   x["target_id"], x["target_slot"], x["type"]))
            into = slot_names[target][target_slot] if target in slot_names else target_slot
            links.add((link_id, origin, origin_slot, target, into, kind))
        return {"nodes": nodes, "links": links}

    assert essence(saved, False) == essence(ui, True)
    for mine, theirs in zip(ui["definitions"]["subgraphs"],
                            saved["definitions"]["subgraphs"], strict=True):
        assert essence(theirs, False) == essence(mine, True)
        # the reroutes come back as they were: each at its place, on the same wires
        assert {r["id"]: (r.get("parentId"), r["pos"], sorted(r["linkIds"]))
                for r in theirs.get("reroutes") or []} == {
            r["id"]: (r.get("parentId"), r["pos"], sorted(r["linkIds"]))
            for r in mine.get("reroutes") or []}
        assert {x["id"]: x.get("parentId") for x in theirs["links"]} == {
            x["id"]: x.get("parentId") for x in mine["links"]}


def _needs_the_modelled_editor(loaded) -> None:
    if not _built_for(loaded):
        release = served_release(loaded[2])[0] or "schemas of no saved release"
        pytest.skip(f"the drawn geometry is modelled for frontend {FRONTEND_VERSION} on a "
                    f"server with the schemas the files were built from ({BUILT_FROM}); this "
                    f"is frontend {loaded[3]} on {release}")


def _geometry():
    spec = importlib.util.spec_from_file_location("build_workflows",
                                                  LAYOUT / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import wire_geometry  # beside build_workflows.py, on the path it set

    return module, wire_geometry


@pytest.mark.parametrize("name", NAMES)
def test_the_drawn_wires_are_the_modelled_ones(loaded, name):
    """Every Bezier the editor draws (recorded from its Path2D calls) is the one
    dev/workflow_layout/wire_geometry.py computes, so the default suite's crossing counts are the
    editor's. Wires from the subgraph's input node may start a few pixels off: that node's
    width follows its labels as the browser's font measures them."""
    _needs_the_modelled_editor(loaded)
    builder, geometry = _geometry()
    schemas = builder.load_schemas()
    result, ui = loaded[0][name], _ui(name)
    for label, graph in _graph_by_label(ui).items():
        drawn = result["layout"][label]["wires"]
        model = {w.id: w for w in geometry.wires(graph, schemas)}
        assert sorted(int(i) for i in drawn) == sorted(model), label
        captured = []
        for link_id, legs in drawn.items():
            wire = model[int(link_id)]
            assert legs is not None and len(legs) == len(wire.legs), (label, link_id)
            slack = 12 if wire.origin[0] == geometry.SUBGRAPH_INPUT_ID else 0.5
            for mine, theirs in zip(wire.legs, legs, strict=True):
                for (x0, y0), (x1, y1) in zip(mine, theirs, strict=True):
                    assert abs(x0 - x1) <= slack and abs(y0 - y1) <= 0.5, (label, link_id)
            captured.append(geometry.Wire(wire.id, wire.origin,
                                          tuple(tuple(map(tuple, leg)) for leg in legs),
                                          wire.keys))
        assert geometry.crossings(captured) == geometry.crossings(list(model.values())), label


@pytest.mark.parametrize("name", NAMES)
def test_nodes_and_groups_do_not_overlap_at_the_editors_sizes(loaded, name):
    _needs_the_modelled_editor(loaded)
    builder, geometry = _geometry()
    schemas = builder.load_schemas()
    result, ui = loaded[0][name], _ui(name)
    for label, graph in _graph_by_label(ui).items():
        sizes = result["layout"][label]["sizes"]
        for node in graph["nodes"]:
            assert sizes[str(node["id"])] == node["size"], (label, node["title"])
        assert geometry.overlaps(graph, schemas) == [], label


def test_screenshots_of_every_graph_are_written(loaded):
    shots = loaded[1]
    for name in NAMES:
        for suffix in ("", "_inside"):
            picture = shots / f"{name}{suffix}.png"
            data = picture.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, picture
