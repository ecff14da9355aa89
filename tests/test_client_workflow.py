"""Workflow handling without a server: UI -> API conversion, title patching, output listing."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_comfy_server import OBJECT_INFO, FakeComfyServer
from test_client import run

from h3_multigpu.client import (
    DEFAULT_TARGETS,
    WorkflowError,
    apply_params,
    load_workflow,
    output_files,
    ui_to_api,
)
from h3_multigpu.client.params import check_pass_geometry, find_nodes, parse_size, parse_target
from h3_multigpu.client.validate import check_prompt
from h3_multigpu.client.workflow import widget_names


def slot(name: str, kind: str, link: int | None, widget: bool = False) -> dict:
    return {"name": name, "type": kind, "link": link, **({"widget": {"name": name}} if widget
                                                          else {})}


def ui_workflow() -> dict:
    """Editor format with a note, a reroute, a primitive, a bypassed and a muted node."""
    nodes = [
        {"id": 1, "type": "UNETLoader", "mode": 0,
         "widgets_values": ["minimax_h3_fl2va.safetensors", "default"]},
        {"id": 2, "type": "CLIPLoader", "widgets_values": ["qwen3vl_h3.safetensors", "minimax"]},
        {"id": 3, "type": "CLIPTextEncode", "title": "Prompt",
         "inputs": [slot("clip", "CLIP", 2), slot("text", "STRING", None, widget=True)],
         "widgets_values": ["a fox"]},
        {"id": 4, "type": "EmptyMiniMaxH3LatentAV", "title": "PASS1 Size",
         "widgets_values": [864, 480, 124]},
        {"id": 5, "type": "KSampler", "title": "PASS1 Sampler",
         "inputs": [slot("model", "MODEL", 1), slot("positive", "CONDITIONING", 3),
                    slot("negative", "CONDITIONING", 4), slot("latent_image", "LATENT", 5),
                    slot("seed", "INT", 6, widget=True)],
         # seed, its control widget, steps, cfg, sampler_name, scheduler, denoise
         "widgets_values": [42, "randomize", 3, 1.0, "res_multistep", "simple", 1.0]},
        {"id": 6, "type": "PrimitiveNode", "title": "Seed", "widgets_values": [42, "fixed"]},
        {"id": 7, "type": "VAELoader", "widgets_values": ["minimax_h3_video_vae.safetensors"]},
        {"id": 8, "type": "VAEDecode",
         "inputs": [slot("samples", "LATENT", 7), slot("vae", "VAE", 8)]},
        {"id": 9, "type": "Reroute", "inputs": [slot("", "*", 9)]},
        {"id": 10, "type": "CreateVideo", "inputs": [slot("images", "IMAGE", 10)],
         "widgets_values": [24]},
        {"id": 11, "type": "MarkdownNote", "widgets_values": ["# how to use"]},
        {"id": 13, "type": "KSampler", "mode": 4,  # bypassed: its latent passes through
         "inputs": [slot("model", "MODEL", None), slot("latent_image", "LATENT", 13)],
         "widgets_values": [0, "fixed", 4, 1.0, "euler", "simple", 0.3]},
        {"id": 14, "type": "SaveImage", "mode": 2, "inputs": [slot("images", "IMAGE", 14)],
         "widgets_values": ["muted"]},
        {"id": 15, "type": "SaveVideo", "inputs": [slot("video", "VIDEO", 12)],
         "widgets_values": ["video/h3", "auto", "auto"]},
    ]
    links = [[1, 1, 0, 5, 0, "MODEL"], [2, 2, 0, 3, 0, "CLIP"], [3, 3, 0, 5, 1, "CONDITIONING"],
             [4, 3, 0, 5, 2, "CONDITIONING"], [5, 13, 0, 5, 3, "LATENT"], [6, 6, 0, 5, 4, "INT"],
             [7, 5, 0, 8, 0, "LATENT"], [8, 7, 0, 8, 1, "VAE"], [9, 8, 0, 9, 0, "IMAGE"],
             [10, 9, 0, 10, 0, "IMAGE"], [13, 4, 0, 13, 1, "LATENT"], [14, 8, 0, 14, 0, "IMAGE"],
             # the newer serialisation writes links as objects
             {"id": 12, "origin_id": 10, "origin_slot": 0, "target_id": 15, "target_slot": 0,
              "type": "VIDEO"}]
    return {"last_node_id": 15, "last_link_id": 14, "nodes": nodes, "links": links,
            "version": 0.4}


def test_ui_workflow_converts_to_the_api_graph_the_editor_would_export():
    api = ui_to_api(ui_workflow(), OBJECT_INFO)
    assert sorted(api, key=int) == ["1", "2", "3", "4", "5", "7", "8", "10", "15"]
    assert api["5"]["inputs"] == {
        "seed": 42, "steps": 3, "cfg": 1.0, "sampler_name": "res_multistep",
        "scheduler": "simple", "denoise": 1.0, "model": ["1", 0], "positive": ["3", 0],
        "negative": ["3", 0], "latent_image": ["4", 0],  # through the bypassed sampler
    }
    assert api["10"]["inputs"] == {"fps": 24, "images": ["8", 0]}  # through the reroute
    assert api["3"]["inputs"] == {"text": "a fox", "clip": ["2", 0]}
    assert api["3"]["_meta"]["title"] == "Prompt"
    assert api["15"]["inputs"] == {"video": ["10", 0], "filename_prefix": "video/h3",
                                   "format": "auto", "codec": "auto"}
    assert check_prompt(api, OBJECT_INFO) == []


def test_ui_workflow_is_converted_patched_and_run(tmp_path):
    with FakeComfyServer() as fake:
        paths, events = run(fake, tmp_path, ui_workflow(), params={"prompt": "a red fox"})
    assert [e["nodes"] for e in events if e["event"] == "converted"] == [9]
    assert fake.prompts_received[0]["prompt"]["3"]["inputs"]["text"] == "a red fox"
    assert paths[0].name == "h3_00001_.mp4"


def test_unknown_classes_and_old_proxy_widgets_are_refused_with_the_fix():
    ui = ui_workflow()
    ui["nodes"].append({"id": 21, "type": "H3NotInstalled"})
    ui["nodes"].append({"id": 22, "type": "MiniMaxH3ImageToVideo"})
    sub_id = "a3c9e0c4-0000-4000-8000-000000000001"
    ui["definitions"] = {"subgraphs": [{"id": sub_id, "name": "old", "nodes": [], "links": [],
                                        "inputs": [], "outputs": []}]}
    ui["nodes"].append({"id": 20, "type": sub_id, "title": "H3 T2V",
                        "properties": {"proxyWidgets": [["3", "text"]]}})
    with pytest.raises(WorkflowError) as info:
        ui_to_api(ui, OBJECT_INFO)
    text = str(info.value)
    assert "class 'H3NotInstalled' is not installed" in text
    assert "node #22" in text and "update ComfyUI" in text
    assert "node #20 'H3 T2V'" in text and "proxyWidgets" in text and "save it" in text


SUB = "5d1c1c5e-7a57-4e2b-9a41-0c6f8f2a9b10"


def subgraph_workflow() -> dict:
    """A subgraph with a promoted widget (seed), a socket fed from outside (an image), an inner
    primitive, a link out through the subgraph's output, and a muted inner node."""
    inner = [
        {"id": 5, "type": "PrimitiveInt", "title": "Seed", "mode": 0,
         "inputs": [slot("value", "INT", 1, widget=True)], "widgets_values": [0, "fixed"]},
        {"id": 6, "type": "KSampler", "title": "Sampler", "mode": 0,
         "inputs": [slot("latent_image", "LATENT", 3), slot("seed", "INT", 2, widget=True)],
         "widgets_values": [0, "fixed", 4, 1.0, "euler", "simple", 0.5]},
        {"id": 7, "type": "VAEDecode", "title": "Decode", "mode": 0,
         "inputs": [slot("samples", "LATENT", 4), slot("vae", "VAE", None)]},
        {"id": 8, "type": "SaveImage", "title": "Muted", "mode": 2,
         "inputs": [slot("images", "IMAGE", None)], "widgets_values": ["x"]},
    ]
    sub = {"id": SUB, "name": "pipeline", "nodes": inner,
           "inputs": [{"id": "8b3a3f5e-8a0c-4a8e-9c51-0c0f8b2a9b11", "name": "seed",
                       "type": "INT", "linkIds": [1]},
                      {"id": "8b3a3f5e-8a0c-4a8e-9c51-0c0f8b2a9b12", "name": "latent",
                       "type": "LATENT", "linkIds": [3]}],
           "outputs": [{"id": "8b3a3f5e-8a0c-4a8e-9c51-0c0f8b2a9b13", "name": "IMAGE",
                        "type": "IMAGE", "linkIds": [5]}],
           "links": [{"id": 1, "origin_id": -10, "origin_slot": 0, "target_id": 5,
                      "target_slot": 0, "type": "INT"},
                     {"id": 2, "origin_id": 5, "origin_slot": 0, "target_id": 6,
                      "target_slot": 1, "type": "INT"},
                     {"id": 3, "origin_id": -10, "origin_slot": 1, "target_id": 6,
                      "target_slot": 0, "type": "LATENT"},
                     {"id": 4, "origin_id": 6, "origin_slot": 0, "target_id": 7,
                      "target_slot": 0, "type": "LATENT"},
                     {"id": 5, "origin_id": 7, "origin_slot": 0, "target_id": -20,
                      "target_slot": 0, "type": "IMAGE"}]}
    nodes = [
        {"id": 1, "type": "EmptyMiniMaxH3LatentAV", "title": "Size", "mode": 0,
         "widgets_values": [864, 480, 124]},
        {"id": 2, "type": SUB, "title": "Pipeline", "mode": 0,
         "inputs": [slot("seed", "INT", None, widget=True), slot("latent", "LATENT", 10)],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [11]}],
         "widgets_values": [1234]},
        {"id": 3, "type": "SaveImage", "title": "Save", "mode": 0,
         "inputs": [slot("images", "IMAGE", 11)], "widgets_values": ["out"],
         "properties": {"cnr_id": "comfy-core"}},
        {"id": 4, "type": "MarkdownNote", "mode": 0, "widgets_values": ["# read me"]},
    ]
    links = [[10, 1, 0, 2, 1, "LATENT"], [11, 2, 0, 3, 0, "IMAGE"]]
    return {"id": "8b3a3f5e-8a0c-4a8e-9c51-0c0f8b2a9b00", "last_node_id": 8,
            "last_link_id": 11, "nodes": nodes, "links": links,
            "definitions": {"subgraphs": [sub]}, "version": 0.4}


def test_subgraphs_are_expanded_as_the_editor_queues_them():
    api = ui_to_api(subgraph_workflow(), OBJECT_INFO)
    assert list(api) == ["1", "2:5", "2:6", "2:7", "3"]  # inner ids "<subgraph node>:<id>"
    assert api["2:5"]["inputs"] == {"value": 1234}  # the promoted widget's value
    assert api["2:6"]["inputs"] == {
        "seed": ["2:5", 0], "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "denoise": 0.5, "latent_image": ["1", 0]}  # from outside
    assert api["3"]["inputs"] == {"filename_prefix": "out", "images": ["2:7", 0]}  # output
    assert api["3"]["_meta"] == {"title": "Save", "cnr_id": "comfy-core"}
    assert "2:8" not in api  # muted inside the subgraph


def test_a_nested_subgraph_gets_a_two_level_id():
    outer = subgraph_workflow()
    inner_id = "5d1c1c5e-7a57-4e2b-9a41-0c6f8f2a9b20"
    inner = {"id": inner_id, "name": "decode", "inputs": [], "links": [],
             "outputs": [{"id": "8b3a3f5e-8a0c-4a8e-9c51-0c0f8b2a9b21", "name": "IMAGE",
                          "type": "IMAGE", "linkIds": [7]}],
             "nodes": [{"id": 9, "type": "EmptyImage", "mode": 0,
                        "widgets_values": [8, 8, 1, 0]}]}
    inner["links"] = [{"id": 7, "origin_id": 9, "origin_slot": 0, "target_id": -20,
                       "target_slot": 0, "type": "IMAGE"}]
    sub = outer["definitions"]["subgraphs"][0]
    sub["definitions"] = {"subgraphs": [inner]}
    sub["nodes"].append({"id": 12, "type": inner_id, "mode": 0,
                         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [6]}]})
    sub["outputs"][0]["linkIds"] = [6]
    sub["links"][-1] = {"id": 6, "origin_id": 12, "origin_slot": 0, "target_id": -20,
                        "target_slot": 0, "type": "IMAGE"}
    api = ui_to_api(outer, OBJECT_INFO)
    assert api["3"]["inputs"]["images"] == ["2:12:9", 0]
    assert api["2:12:9"]["class_type"] == "EmptyImage"


def test_dynamic_combo_and_autogrow_inputs_keep_their_dotted_names():
    info = {
        "SaveVideo": {"input": {"required": {
            "video": ["VIDEO", {}], "filename_prefix": ["STRING", {}],
            "format": ["COMFY_DYNAMICCOMBO_V3", {"options": [
                {"key": "auto", "inputs": {"required": {"codec": ["COMFY_DYNAMICCOMBO_V3", {
                    "options": [{"key": "auto", "inputs": {"required": {}}},
                                {"key": "h264", "inputs": {"optional": {
                                    "crf": ["FLOAT", {"default": 23.0}]}}}]}]}}},
                {"key": "webm", "inputs": {"required": {}}}]}]}},
            "input_order": {"required": ["video", "filename_prefix", "format"]},
            "output": [], "output_node": True},
        "Refs": {"input": {"optional": {"refs": ["COMFY_AUTOGROW_V3", {"template": {
            "input": {"required": {"ref": ["IMAGE", {}]}}, "prefix": "ref_", "min": 0,
            "max": 3}}]}}, "input_order": {"optional": ["refs"]}, "output": ["CONDITIONING"]},
        "LoadImage": OBJECT_INFO.get("LoadImage") or {
            "input": {"required": {"image": [["a.png"], {"image_upload": True}]}},
            "input_order": {"required": ["image"]}, "output": ["IMAGE", "MASK"]},
    }
    ui = {"nodes": [
        {"id": 1, "type": "SaveVideo", "mode": 0, "inputs": [slot("video", "VIDEO", None)],
         "widgets_values": ["v/h3", "auto", "h264", 18.0]},
        {"id": 2, "type": "LoadImage", "mode": 0, "widgets_values": ["a.png", "image"]},
        {"id": 3, "type": "Refs", "mode": 0,
         "inputs": [slot("refs.ref_0", "IMAGE", 1), slot("refs.ref_1", "IMAGE", None)]},
    ], "links": [[1, 2, 0, 3, 0, "IMAGE"]], "version": 0.4}
    api = ui_to_api(ui, info)
    assert api["1"]["inputs"] == {"filename_prefix": "v/h3", "format": "auto",
                                  "format.codec": "h264", "format.codec.crf": 18.0}
    assert api["2"]["inputs"] == {"image": "a.png"}  # the upload widget feeds no input
    assert api["3"]["inputs"] == {"refs.ref_0": ["2", 0]}
    problems = check_prompt(api, info)
    assert [p.message for p in problems] == ["required input 'video' is missing; connect or "
                                             "set it (a workflow saved by a newer ComfyUI may "
                                             "name it differently: update the server)"]
    api["1"]["inputs"]["format.codec"] = "vp9"
    assert "'format.codec' = 'vp9' is not offered" in str(check_prompt(api, info))


def test_widget_order_follows_input_order_and_skips_sockets():
    assert widget_names(OBJECT_INFO["KSampler"]) == [
        "seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"]
    assert widget_names(OBJECT_INFO["SaveVideo"]) == ["filename_prefix", "format", "codec"]


def test_patching_a_linked_input_points_at_the_source_node():
    api = ui_to_api(ui_workflow(), OBJECT_INFO)
    api["3"]["inputs"]["text"] = ["2", 0]
    with pytest.raises(WorkflowError, match=r"linked to node #2 \(CLIPLoader\)"):
        apply_params(api, {"prompt": "x"})


def test_patching_is_a_copy_and_lists_changes():
    api = ui_to_api(ui_workflow(), OBJECT_INFO)
    patched, changes = apply_params(api, {"pass1_size": (1312, 736), "seed": None})
    assert api["4"]["inputs"]["width"] == 864  # the caller's graph is untouched
    assert patched["4"]["inputs"]["width"] == 1312
    assert changes == ["node #4 'PASS1 Size' (EmptyMiniMaxH3LatentAV).width = 1312",
                       "node #4 'PASS1 Size' (EmptyMiniMaxH3LatentAV).height = 736"]


def test_size_and_map_parsing_errors_name_the_fix():
    assert parse_size("864x480") == (864, 480)
    with pytest.raises(ValueError, match="1296x720 is not valid for H3.*multiples of 32"):
        parse_size("1296x720")
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_size("864")
    name, target = parse_target("seed=My Seed: v2:noise_seed")
    assert (name, target.title, target.inputs) == ("seed", "My Seed: v2", ("noise_seed",))
    with pytest.raises(ValueError, match="NAME=TITLE:INPUT"):
        parse_target("seed")


def test_output_files_lists_videos_gifs_audio_once():
    entry = {"outputs": {
        "11": {"images": [{"filename": "a.mp4", "subfolder": "video", "type": "output"}],
               "animated": [True]},
        "12": {"gifs": [{"filename": "b.webm", "subfolder": "", "type": "output"}],
               "text": ["not a file"]},
        "13": {"audio": [{"filename": "c.flac", "subfolder": "", "type": "output"}],
               "videos": [{"filename": "a.mp4", "subfolder": "video", "type": "output"}]},
    }}
    refs = output_files(entry)
    assert [(r["filename"], r["kind"], r["node"]) for r in refs] == [
        ("a.mp4", "images", "11"), ("b.webm", "gifs", "12"), ("c.flac", "audio", "13")]


BUNDLED = sorted((Path(__file__).resolve().parent.parent / "workflows" / "api").glob("*.json"))


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_every_flag_finds_its_node_in_the_bundled_workflows(path):
    prompt = load_workflow(path)
    params = {"prompt": "a lighthouse at dusk", "seconds": 10, "seed": 7, "steps": 8,
              "pass1_steps": 8, "pass2_steps": 4, "pass1_size": "864x480",
              "pass2_size": "1312x736", "turbo": True}
    patched, changes = apply_params(prompt, params)
    assert len(changes) == 11, changes  # each flag hit exactly the node(s) meant for it
    assert check_pass_geometry(patched) == []
    lora = find_nodes(prompt, DEFAULT_TARGETS["turbo"])
    assert len(lora) == 1
    bypassed, _ = apply_params(prompt, {"turbo": False})
    assert lora[0] not in bypassed
    assert not any(v[:1] == [lora[0]] for n in bypassed.values() for v in n["inputs"].values()
                   if isinstance(v, list))


def test_no_turbo_rewires_consumers_of_the_lora_to_its_model_source():
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {}},
        "2": {"class_type": "LoraLoaderModelOnly", "_meta": {"title": "Turbo LoRA"},
              "inputs": {"model": ["1", 0], "lora_name": "t.safetensors", "strength_model": 1}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "latent_image": ["9", 0]}},
    }
    kept, changes = apply_params(prompt, {"turbo": True})
    assert kept == prompt and changes == ["node #2 'Turbo LoRA' (LoraLoaderModelOnly) kept"]
    bypassed, changes = apply_params(prompt, {"turbo": False})
    assert sorted(bypassed) == ["1", "3"]
    assert bypassed["3"]["inputs"] == {"model": ["1", 0], "latent_image": ["9", 0]}
    assert "bypassed" in changes[0]
    assert prompt["3"]["inputs"]["model"] == ["2", 0]  # the caller's graph is untouched


def test_missing_h3_classes_say_which_comfyui_is_needed():
    graph = {"1": {"class_type": "MiniMaxH3ImageToVideo", "inputs": {}},
             "2": {"class_type": "MiniMaxH3LatentUpscaleWithModel", "inputs": {}},
             "3": {"class_type": "H3MultiGPU", "inputs": {}}}
    text = "\n".join(str(p) for p in check_prompt(graph, OBJECT_INFO))
    assert "MiniMax H3 nodes (ComfyUI#15224 or newer; update ComfyUI)" in text
    assert "use this pack's 'H3 Latent Upscale'" in text
    assert "install or update this pack (comfyui-h3-multigpu)" in text
