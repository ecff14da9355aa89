"""The bundled workflows: known node types, well-typed links, UI and API twins describing the
same graph, titles the client patches, sizes and frame counts valid for H3."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from h3_multigpu import geometry, nodes
from h3_multigpu.nodes import inputs

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
DATA = Path(__file__).resolve().parent / "data"
# the project's shared/ folder sits beside the checkout (CI lays a copy there too)
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "reference" / "templates"
NAMES = ("h3_multigpu_two_pass_t2v", "h3_multigpu_two_pass_i2v")
TITLES = ("Prompt", "Seconds", "Seed", "PASS1 Width", "PASS1 Height", "PASS2 Width",
          "PASS2 Height", "PASS1 Steps", "PASS2 Steps", "Turbo LoRA", "Save Video")

CORE = json.loads((DATA / "core_node_schemas.json").read_text())["nodes"]
PACK = json.loads((DATA / "pack_node_schemas.json").read_text())["nodes"]
SCHEMAS = {**CORE, **PACK}


def _load(name: str) -> tuple[dict, dict]:
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    api = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    return ui, api


def _builder():
    spec = importlib.util.spec_from_file_location("build_workflows",
                                                  WORKFLOWS / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _ui_as_api(ui: dict) -> dict:
    """Read a UI-format workflow into API form using the pinned schemas (independently of the
    builder): widgets_values by widget order, frontend-only extras skipped, links resolved."""
    links = {link[0]: link for link in ui["links"]}
    out = {}
    for node in ui["nodes"]:
        schema = SCHEMAS[node["type"]]
        linked = {i["name"]: links[i["link"]] for i in node["inputs"] if i.get("link") is not None}
        values = list(node["widgets_values"])
        inputs_ = {}
        for spec in schema["inputs"]:
            if spec.get("widget"):
                value = values.pop(0)
                if "ui_extra" in spec:
                    assert values.pop(0) in ("fixed", "randomize", "image")
                if spec["name"] not in linked:
                    inputs_[spec["name"]] = value
            if spec["name"] in linked:
                link = linked[spec["name"]]
                inputs_[spec["name"]] = [str(link[1]), link[2]]
        assert values == [], f"node {node['id']} has extra widget values {values}"
        out[str(node["id"])] = {"class_type": node["type"], "inputs": inputs_,
                                "_meta": {"title": node["title"]}}
    return out


@pytest.fixture(params=NAMES)
def workflow(request):
    return request.param, *_load(request.param)


def test_every_node_type_is_ours_or_a_pinned_core_node(workflow):
    _, ui, api = workflow
    for node in ui["nodes"]:
        kind = node["type"]
        assert kind in SCHEMAS, f"{kind} is neither a pack node nor a pinned core node"
        if kind.startswith("H3MultiGPU"):
            assert kind in nodes.NODE_IDS
        else:
            assert CORE[kind]["source"]
    assert {n["class_type"] for n in api.values()} == {n["type"] for n in ui["nodes"]}


def test_links_are_well_formed_and_typed(workflow):
    _, ui, _ = workflow
    by_id = {n["id"]: n for n in ui["nodes"]}
    ids = [link[0] for link in ui["links"]]
    assert len(ids) == len(set(ids)) and max(ids) == ui["last_link_id"]
    assert max(by_id) == ui["last_node_id"]
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        source, target = by_id[src], by_id[dst]
        out_spec = SCHEMAS[source["type"]]["outputs"][src_slot]
        assert out_spec["type"] == kind, f"link {link_id}: {source['type']} gives {out_spec}"
        assert link_id in (source["outputs"][src_slot]["links"] or [])
        ends = [i for i in target["inputs"] if i.get("link") == link_id]
        assert len(ends) == 1, f"link {link_id} must end at exactly one input"
        in_spec = SCHEMAS[target["type"]]["inputs"][dst_slot]
        assert in_spec["name"] == ends[0]["name"], f"link {link_id}: slot and name disagree"
        assert in_spec["type"] == kind == ends[0]["type"], (
            f"link {link_id}: {source['type']}.{out_spec['name']} ({kind}) -> "
            f"{target['type']}.{in_spec['name']} ({in_spec['type']})")
    for node in ui["nodes"]:  # every required socket is connected: nothing fails validation
        connected = {i["name"] for i in node["inputs"] if i.get("link") is not None}
        for spec in SCHEMAS[node["type"]]["inputs"]:
            if not spec.get("widget") and not spec.get("optional"):
                assert spec["name"] in connected, f"{node['title']}.{spec['name']} is unlinked"


def test_execution_order_respects_links(workflow):
    _, ui, _ = workflow
    order = {n["id"]: n["order"] for n in ui["nodes"]}
    assert sorted(order.values()) == list(range(len(order)))
    for _, src, _, dst, _, _ in ui["links"]:
        assert order[src] < order[dst]


def test_ui_and_api_describe_the_same_graph(workflow):
    _, ui, api = workflow
    assert _ui_as_api(ui) == api


def test_files_are_what_the_builder_writes(workflow):
    name, ui, api = workflow
    built_ui, built_api = _builder().build_all()[name]
    assert built_ui == ui and built_api == api, "run: python workflows/build_workflows.py"


def test_every_node_has_a_unique_title_and_the_client_titles_exist(workflow):
    _, ui, api = workflow
    titles = [n["title"] for n in ui["nodes"]]
    assert all(t.strip() for t in titles) and len(titles) == len(set(titles))
    by_title = {n["_meta"]["title"]: n for n in api.values()}
    for title in TITLES:
        assert title in by_title, f"missing node titled {title!r}"
    assert by_title["Save Video"]["class_type"] == "SaveVideo"
    assert by_title["Turbo LoRA"]["class_type"] == "LoraLoaderModelOnly"
    assert by_title["Seconds"]["inputs"]["seconds"] == 5.0
    assert by_title["Prompt"]["inputs"]["value"].strip()


def _by_title(api: dict) -> dict:
    return {n["_meta"]["title"]: (node_id, n) for node_id, n in api.items()}


def _source(api: dict, node: dict, name: str) -> tuple[str, dict, int]:
    node_id, slot = node["inputs"][name]
    return node_id, api[node_id], slot


def test_sizes_and_frames_are_valid_and_wired_where_they_belong(workflow):
    _, _, api = workflow
    t = _by_title(api)
    value = {k: t[k][1]["inputs"]["value"] for k in
             ("PASS1 Width", "PASS1 Height", "PASS2 Width", "PASS2 Height")}
    assert (value["PASS1 Width"], value["PASS1 Height"]) == (864, 480)
    assert (value["PASS2 Width"], value["PASS2 Height"]) == (1312, 736)  # not 1.5x = 1280x704
    assert inputs.check_two_pass(value["PASS1 Width"], value["PASS1 Height"],
                                 value["PASS2 Width"], value["PASS2 Height"]) is None
    cond = next(n for n in api.values() if n["class_type"] == "MiniMaxH3ImageToVideo")
    upscale = next(n for n in api.values()
                   if n["class_type"] == "MiniMaxH3LatentUpscaleWithModel")
    plan = next(n for n in api.values() if n["class_type"] == "H3MultiGPUPlan")
    wiring = {(id(cond), "width"): "PASS1 Width", (id(cond), "height"): "PASS1 Height",
              (id(upscale), "width"): "PASS2 Width", (id(upscale), "height"): "PASS2 Height",
              (id(plan), "pass1_width"): "PASS1 Width", (id(plan), "pass2_height"): "PASS2 Height"}
    nodes_by_key = {id(cond): cond, id(upscale): upscale, id(plan): plan}
    for (key, name), title in wiring.items():
        assert nodes_by_key[key]["inputs"][name][0] == t[title][0], f"{name} not from {title}"
    seconds_id = t["Seconds"][0]
    assert cond["inputs"]["length"] == [seconds_id, 0]  # frames output
    assert plan["inputs"]["seconds"] == [seconds_id, 1]  # the clip's real length
    frames, _ = inputs.seconds_to_frames(t["Seconds"][1]["inputs"]["seconds"])
    assert geometry.validate_frames(frames) == 124
    for width, height in ((864, 480), (1312, 736)):
        assert geometry.PassGeometry(width, height, frames).tokens in (15_399, 35_305)


def test_pass2_is_a_short_renoise_of_the_upscaled_pass1(workflow):
    _, _, api = workflow
    t = _by_title(api)
    pass1, pass2 = t["PASS1 Sampler"][1], t["PASS2 Sampler"][1]
    sched1, sched2 = t["PASS1 Schedule"][1], t["PASS2 Schedule"][1]
    assert pass2["inputs"]["latent_image"][0] == t["Latent Upscale"][0]
    assert api[t["Latent Upscale"][0]]["inputs"]["samples"] == [t["PASS1 Sampler"][0], 0]
    assert pass1["inputs"]["sigmas"][0] == t["PASS1 Schedule"][0]
    assert pass2["inputs"]["sigmas"][0] == t["PASS2 Schedule"][0]
    assert sched1["inputs"]["denoise"] == 1.0
    assert 0.0 < sched2["inputs"]["denoise"] <= 0.5
    steps1 = t["PASS1 Steps"][1]["inputs"]["value"]
    steps2 = t["PASS2 Steps"][1]["inputs"]["value"]
    assert sched1["inputs"]["steps"] == [t["PASS1 Steps"][0], 0]
    assert sched2["inputs"]["steps"] == [t["PASS2 Steps"][0], 0]
    assert 0 < steps2 < steps1
    # The same placed model samples both passes (one DiT resident on the root GPU).
    place = t["Multi-GPU Placement"][0]
    assert sched1["inputs"]["model"] == sched2["inputs"]["model"] == [place, 0]


def test_components_come_from_the_placement_node(workflow):
    _, _, api = workflow
    t = _by_title(api)
    place = t["Multi-GPU Placement"][0]
    assert t["Decode Video"][1]["inputs"]["vae"] == [place, 2]
    assert t["Decode Audio"][1]["inputs"]["vae"] == [place, 3]
    assert t["Latent Upscale"][1]["inputs"]["model"] == [place, 4]
    assert t["PASS1 Conditioning"][1]["inputs"]["clip"] == [place, 1]
    assert t["Release Text Encoder"][1]["inputs"]["clip"] == [place, 1]
    assert t["GPU Status"][1]["inputs"]["text"] == [place, 6]
    assert PACK["H3MultiGPUShowText"]["output_node"] and CORE["SaveVideo"]["output_node"]


def test_image_to_video_reanchors_keyframes_at_pass2_size():
    _, api = _load("h3_multigpu_two_pass_i2v")
    t = _by_title(api)
    keys = t["PASS2 Keyframes"][1]
    assert keys["inputs"]["latent"] == [t["Latent Upscale"][0], 0]
    assert keys["inputs"]["first_frame"] == [t["First Frame"][0], 0]
    assert t["PASS2 Guider"][1]["inputs"]["conditioning"] == [t["PASS2 Keyframes"][0], 0]
    assert t["PASS2 Sampler"][1]["inputs"]["guider"][0] == t["PASS2 Guider"][0]
    assert t["PASS1 Conditioning"][1]["inputs"]["first_frame"] == [t["First Frame"][0], 0]


def test_model_files_are_the_official_templates_names(workflow):
    if not TEMPLATES.is_dir():
        pytest.skip("official templates not present")
    _, ui, _ = workflow
    official = " ".join(p.read_text() for p in TEMPLATES.glob("*.json"))
    loaders = {"UNETLoader": "unet_name", "CLIPLoader": "clip_name", "VAELoader": "vae_name",
               "LoraLoaderModelOnly": "lora_name"}
    _, api = _load(workflow[0])
    for node in api.values():
        key = loaders.get(node["class_type"])
        if key:
            assert f'"{node["inputs"][key]}"' in official, node["inputs"][key]


def test_templates_folder_is_the_one_comfyui_scans():
    # ComfyUI's custom_node_manager lists */workflows/*.json (top level only) as templates.
    assert sorted(p.stem for p in WORKFLOWS.glob("*.json")) == sorted(NAMES)
    assert sorted(p.stem for p in (WORKFLOWS / "api").glob("*.json")) == sorted(NAMES)


def test_docs_name_every_node_and_title():
    text = (ROOT / "docs" / "nodes.md").read_text()
    for node_id in nodes.NODE_IDS:
        assert f"`{node_id}`" in text, node_id
    for title in TITLES:
        assert f'"{title}"' in text, title


def test_picture_is_rendered_from_the_t2v_workflow():
    pil = pytest.importorskip("PIL.Image")
    spec = importlib.util.spec_from_file_location("render_workflow",
                                                  ROOT / "tools" / "render_workflow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ui, _ = _load("h3_multigpu_two_pass_t2v")
    image = module.render(ui, "title")
    shipped = pil.open(ROOT / "docs" / "images" / "two_pass_t2v.png")
    assert shipped.size == image.size
