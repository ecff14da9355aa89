"""The client against a real ComfyUI (CPU, no weights): set COMFYUI_PATH to run.

    COMFYUI_PATH=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python \
        python -m pytest -q -m comfyui -o addopts="--strict-markers" tests/test_client*.py
"""

from __future__ import annotations

import os
import struct
import uuid

import pytest
from comfyui_harness import start_comfyui

from h3_multigpu.client import ComfyClient, PromptRejected, submit, ui_to_api

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfyui_url():
    with start_comfyui(os.environ["COMFYUI_PATH"]) as url:
        yield url


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def empty_image_graph(width: int = 64, height: int = 48) -> dict:
    return {
        "1": {"class_type": "EmptyImage", "_meta": {"title": "Canvas"},
              "inputs": {"width": width, "height": height, "batch_size": 1, "color": 0xFF0000}},
        "2": {"class_type": "SaveImage", "_meta": {"title": "Save"},
              "inputs": {"images": ["1", 0], "filename_prefix": "h3_client/test"}},
    }


def test_submit_downloads_the_png_a_real_server_writes(comfyui_url, tmp_path):
    events: list[dict] = []
    paths = submit(empty_image_graph(), server=comfyui_url, out_dir=tmp_path,
                   on_event=events.append, timeout_s=120)
    assert len(paths) == 1 and paths[0].parent == tmp_path
    assert png_size(paths[0].read_bytes()) == (64, 48)
    kinds = [e["event"] for e in events]
    for kind in ("validated", "queued", "started", "executed", "downloaded", "done"):
        assert kind in kinds, kinds
    # The server kept our prompt_id: its history is keyed by the id the client chose.
    prompt_id = next(e for e in events if e["event"] == "queued")["prompt_id"]
    assert ComfyClient(comfyui_url).history(prompt_id)["status"]["status_str"] == "success"


def test_real_400_is_parsed_into_node_errors(comfyui_url):
    graph = empty_image_graph()
    graph["1"]["inputs"]["width"] = 0  # below EmptyImage's minimum of 1
    with pytest.raises(PromptRejected) as info:
        # a canonical UUID: 0.33.0 refuses any other prompt_id (invalid_prompt_id) before it
        # looks at the graph
        ComfyClient(comfyui_url).post_prompt(graph, str(uuid.uuid4()))
    assert "1" in info.value.response["node_errors"]


def test_ui_workflow_converts_with_the_real_object_info(comfyui_url, tmp_path):
    ui = {
        "nodes": [
            {"id": 5, "type": "EmptyImage", "mode": 0, "outputs": [{"links": [1]}],
             "widgets_values": [32, 16, 1, 0]},
            {"id": 6, "type": "Note", "mode": 0, "widgets_values": ["ignored"]},
            {"id": 7, "type": "SaveImage", "mode": 0,
             "inputs": [{"name": "images", "type": "IMAGE", "link": 1}],
             "widgets_values": ["h3_client/ui"]},
        ],
        "links": [[1, 5, 0, 7, 0, "IMAGE"]],
        "version": 0.4,
    }
    client = ComfyClient(comfyui_url)
    api = ui_to_api(ui, client.object_info())
    assert api["5"]["inputs"] == {"width": 32, "height": 16, "batch_size": 1, "color": 0}
    paths = submit(ui, out_dir=tmp_path, client=client, timeout_s=120)
    assert png_size(paths[0].read_bytes()) == (32, 16)
