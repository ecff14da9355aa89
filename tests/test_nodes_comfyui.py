"""The pack inside a real ComfyUI (CPU): registered nodes, their schemas, a weightless run.

    COMFYUI_PATH=/work/comfyui COMFYUI_PYTHON=/work/comfyui-venv/bin/python \
        python -m pytest -q -m comfyui -o addopts="--strict-markers" tests/test_nodes*.py
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from h3_multigpu import nodes
from h3_multigpu.nodes.planning import make_plan

pytestmark = pytest.mark.comfyui

DATA = Path(__file__).resolve().parent / "data"
WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
CORE = json.loads((DATA / "core_node_schemas.json").read_text())["nodes"]
PACK = json.loads((DATA / "pack_node_schemas.json").read_text())
SIZES = {"pass2_width": 1312, "pass2_height": 736, "pass1_width": 864, "pass1_height": 480}


@pytest.fixture(scope="module")
def comfyui_url():
    from comfyui_harness import start_comfyui

    with start_comfyui(os.environ["COMFYUI_PATH"]) as url:
        yield url


@pytest.fixture(scope="module")
def object_info(comfyui_url):
    return _get(comfyui_url, "/object_info")


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.load(response)


def _post_prompt(url: str, graph: dict) -> tuple[int, dict]:
    body = json.dumps({"prompt": graph, "client_id": uuid.uuid4().hex}).encode()
    request = urllib.request.Request(url + "/prompt", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _wait_history(url: str, prompt_id: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        history = _get(url, f"/history/{prompt_id}")
        if prompt_id in history and history[prompt_id].get("status", {}).get("completed"):
            return history[prompt_id]
        if prompt_id in history and history[prompt_id].get("status", {}).get(
                "status_str") == "error":
            return history[prompt_id]
        time.sleep(0.3)
    raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout_s} s")


def _inputs(info: dict) -> dict[str, tuple[str, list, dict]]:
    """name -> (type, combo options, extra) from one /object_info entry, old or new style."""
    out = {}
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            kind, extra = spec[0], (spec[1] if len(spec) > 1 else {})
            options = kind if isinstance(kind, list) else extra.get("options", [])
            out[name] = ("COMBO" if isinstance(kind, list) else kind, options, extra)
    return out


def _ordered(info: dict) -> tuple[list[str], list[str]]:
    """(required names, optional names) in the order ComfyUI shows them."""
    return (list(info["input"].get("required", {})), list(info["input"].get("optional", {})))


def _ordered_pin(specs: list[dict]) -> tuple[list[str], list[str]]:
    return ([s["name"] for s in specs if not s.get("optional")],
            [s["name"] for s in specs if s.get("optional")])


def test_every_pack_node_is_registered_in_the_category(object_info):
    missing = [n for n in nodes.NODE_IDS if n not in object_info]
    assert not missing, f"not registered: {missing}"
    for node_id in nodes.NODE_IDS:
        assert object_info[node_id]["category"] == "H3 Multi-GPU"
        assert object_info[node_id]["python_module"].startswith("custom_nodes.")


def test_pack_schemas_match_what_comfyui_serves(object_info):
    for node_id, pinned in PACK["nodes"].items():
        served = _inputs(object_info[node_id])
        assert _ordered(object_info[node_id]) == _ordered_pin(pinned["inputs"]), node_id
        for spec in pinned["inputs"]:
            kind, options, extra = served[spec["name"]]
            assert kind == spec["type"], f"{node_id}.{spec['name']}"
            for key in ("default", "min", "max", "step"):
                if key in spec:
                    assert extra.get(key) == spec[key], f"{node_id}.{spec['name']}.{key}"
            for option in spec.get("options", []) + spec.get("options_include", []):
                assert option in options, f"{node_id}.{spec['name']} lacks {option!r}"
            in_optional = spec["name"] in object_info[node_id]["input"].get("optional", {})
            assert in_optional == bool(spec.get("optional")), f"{node_id}.{spec['name']}"
        assert object_info[node_id]["output"] == [o["type"] for o in pinned["outputs"]]
        assert object_info[node_id]["output_name"] == [o["name"] for o in pinned["outputs"]]
        assert object_info[node_id]["output_node"] == bool(pinned.get("output_node"))
    for node_id, advanced in PACK["advanced"].items():
        base = _ordered(object_info[advanced["base"]])
        required, optional = _ordered(object_info[node_id])
        assert required[: len(base[0])] == base[0] and optional[: len(base[1])] == base[1]
        assert sorted(required[len(base[0]):] + optional[len(base[1]):]) == sorted(
            advanced["adds"]), node_id
        assert object_info[node_id]["output"] == object_info[advanced["base"]]["output"]


def test_pinned_core_schemas_match_this_comfyui(object_info):
    has_h3 = "MiniMaxH3ImageToVideo" in object_info
    checked = 0
    for node_id, pinned in CORE.items():
        if node_id not in object_info:
            continue  # older ComfyUI (e.g. no H3 nodes): nothing to compare
        served = _inputs(object_info[node_id])
        for spec in pinned["inputs"]:
            if spec.get("nested"):
                continue  # a DynamicCombo child: not a top-level input in /object_info
            assert spec["name"] in served, f"{node_id} has no input {spec['name']}"
            assert served[spec["name"]][0] == spec["type"], f"{node_id}.{spec['name']}"
            if has_h3:  # options added with H3 support (CLIPLoader type 'minimax')
                for option in spec.get("options_include", []):
                    assert option in served[spec["name"]][1], f"{node_id}.{spec['name']}"
        if has_h3 or "newest" not in pinned["read"]:  # outputs pinned from the newest copy
            assert object_info[node_id]["output"][: len(pinned["outputs"])] == [  # may be
                o["type"] for o in pinned["outputs"]], node_id  # absent in older ones
        checked += 1
    assert checked >= 12  # the loaders, samplers and primitives exist in every recent ComfyUI


def test_a_plan_runs_and_its_report_is_shown(comfyui_url):
    graph = {
        "1": {"class_type": "H3MultiGPUSeconds", "inputs": {"seconds": 12.0}},
        "2": {"class_type": "H3MultiGPUPlan",
              "inputs": {**SIZES, "seconds": ["1", 1], "devices": "2xR9700", "lora_rank": 128}},
        "3": {"class_type": "H3MultiGPUShowText", "inputs": {"text": ["2", 1]}},
    }
    status, answer = _post_prompt(comfyui_url, graph)
    assert status == 200 and not answer["node_errors"], answer
    entry = _wait_history(comfyui_url, answer["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    shown = entry["outputs"]["3"]["text"][0]
    expected = make_plan(**SIZES, seconds=294 / 24, devices="2xR9700", lora_rank=128).report()
    assert shown == expected
    assert "294 frames" in shown and "gpu:1" in shown


def test_bad_canvas_is_refused_before_running_with_the_fix(comfyui_url):
    graph = {
        "1": {"class_type": "H3MultiGPUPlan",
              "inputs": {**SIZES, "pass2_width": 1296, "pass2_height": 720, "seconds": 5.0,
                         "devices": "2xR9700", "lora_rank": 128}},
        "2": {"class_type": "H3MultiGPUShowText", "inputs": {"text": ["1", 1]}},
    }
    status, answer = _post_prompt(comfyui_url, graph)
    assert status == 400
    errors = json.dumps(answer["node_errors"]["1"])
    assert "1296x720 is not valid" in errors and "multiples of 32" in errors


def test_bundled_workflows_use_only_nodes_this_comfyui_has(object_info):
    if "MiniMaxH3ImageToVideo" not in object_info:
        pytest.skip("this ComfyUI predates the MiniMax H3 nodes")
    for path in (WORKFLOWS / "api").glob("*.json"):
        graph = json.loads(path.read_text())
        missing = {n["class_type"] for n in graph.values()} - set(object_info)
        assert not missing, f"{path.name}: {missing}"


PROBE = r'''
import importlib.util, sys, torch
comfyui, pack = sys.argv[1], sys.argv[2]
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
import comfy.options
comfy.options.enable_args_parsing()
import comfy.model_management as mm, comfy.model_patcher as mp
spec = importlib.util.spec_from_file_location("h3pack", pack + "/__init__.py",
                                              submodule_search_locations=[pack])
module = importlib.util.module_from_spec(spec)
sys.modules["h3pack"] = module
spec.loader.exec_module(module)
from h3pack.nodes import comfy_placement as cp
cpu = torch.device("cpu")
dit = mp.ModelPatcher(torch.nn.Linear(4, 4), load_device=cpu, offload_device=cpu)
placed, note = cp.place_model(dit, 1)
print("PLACED", placed is not dit, placed.load_device, dit.load_device, note)
class Encoder: pass
encoder, other = Encoder(), mp.ModelPatcher(torch.nn.Linear(2, 2), load_device=cpu,
                                            offload_device=cpu)
encoder.patcher = mp.ModelPatcher(torch.nn.Linear(8, 8), load_device=cpu, offload_device=cpu)
mm.load_models_gpu([encoder.patcher, other])
print("LOADED", len(mm.current_loaded_models))
print("RELEASE", cp.release_text_encoder(encoder))
print("LEFT", [lm.model is other for lm in mm.current_loaded_models])
print("AGAIN", cp.release_text_encoder(encoder))
'''


def test_placement_and_release_on_real_comfyui_objects(tmp_path):
    """A real ModelPatcher is retargeted and a loaded encoder released by public calls only."""
    import subprocess
    import sys

    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    pack = str(Path(__file__).resolve().parents[1])
    run = subprocess.run([python, str(script), os.environ["COMFYUI_PATH"], pack],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.environ["COMFYUI_PATH"])
    lines = {line.split(" ", 1)[0]: line for line in run.stdout.splitlines()}
    assert run.returncode == 0, run.stderr[-3000:]
    assert lines["PLACED"].startswith("PLACED True cuda:1 cpu DiT -> gpu:1"), lines["PLACED"]
    assert lines["LOADED"] == "LOADED 2"
    assert "released from cpu (1 model(s) unloaded)" in lines["RELEASE"]
    assert lines["LEFT"] == "LEFT [True]"  # the other model stays loaded
    assert "nothing to release" in lines["AGAIN"]
