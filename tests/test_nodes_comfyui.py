"""The pack inside a real ComfyUI (CPU): registered nodes, their schemas, a weightless run.

    COMFYUI_PATH=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/comfyui-venv/bin/python \
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
PACK = json.loads((DATA / "object_info_pack.json").read_text())["served"]
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


def test_every_pack_node_is_registered_in_the_category(object_info):
    missing = [n for n in nodes.NODE_IDS if n not in object_info]
    assert not missing, f"not registered: {missing}"
    for node_id in nodes.NODE_IDS:
        assert object_info[node_id]["category"] == "H3 Multi-GPU"
        assert object_info[node_id]["python_module"].startswith("custom_nodes.")


def test_pack_schemas_match_what_comfyui_serves(object_info):
    """tests/data/object_info_pack.json (the workflows are generated from it) is what a real
    ComfyUI serves for this pack; regenerate it with dev/tools/capture_pack_schemas.py.

    Every field the pinned file holds must be served as pinned (inputs, types, defaults,
    ranges, options, tooltips, order, outputs, names, descriptions); fields a release adds to
    every schema (0.33.0: dev_only, essentials_category, has_intermediate_output, ...) and
    the pinned file does not hold are left out of the comparison."""
    for node_id, pinned in PACK.items():
        served = json.loads(json.dumps(object_info[node_id]))
        pinned = json.loads(json.dumps(pinned))
        for entry in (served, pinned):
            entry.pop("python_module", None)  # custom_nodes.<the folder it was cloned into>
            files = entry["input"]["required"].get("upscaler_name")
            if files:
                files[1]["options"] = "<files>"
            device = entry["input"]["required"].get("device")
            if device and device[0] == "COMBO":  # this machine's devices (0.33.0 adds "cpu")
                assert device[1]["options"][0] == "default", device
                device[1]["options"] = "<this machine's devices>"
        assert _only_pinned_fields(served, pinned) == pinned, node_id


def _only_pinned_fields(served, pinned):
    """`served` without the dict keys `pinned` does not have (recursively, lists by position)."""
    if isinstance(served, dict) and isinstance(pinned, dict):
        return {k: _only_pinned_fields(v, pinned[k]) for k, v in served.items() if k in pinned}
    if isinstance(served, list) and isinstance(pinned, list) and len(served) == len(pinned):
        return [_only_pinned_fields(a, b) for a, b in zip(served, pinned, strict=True)]
    return served


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
print("CORE", cp._core_node("SelectModelDeviceNode") is not None)
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
    if lines["CORE"] == "CORE True":
        # core Select Model Device (0.33.0, newest): gpu:1 does not exist on a CPU bed, and
        # core passes the model through; the note says where it stays
        assert lines["PLACED"] == ("PLACED True cpu cpu DiT: asked for gpu:1 but it stays on "
                                   "cpu (core Select Model Device); check the ComfyUI log")
    else:  # older ComfyUI: a clone retargeted by the pack
        assert lines["PLACED"].startswith("PLACED True cuda:1 cpu DiT -> gpu:1"), \
            lines["PLACED"]
    assert lines["LOADED"] == "LOADED 2"
    assert "released from cpu (1 model(s) unloaded)" in lines["RELEASE"]
    assert lines["LEFT"] == "LEFT [True]"  # the other model stays loaded
    assert "nothing to release" in lines["AGAIN"]
