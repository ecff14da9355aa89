"""The bundled workflows against the real node schemas (tests/data/object_info_*.json): link
records that agree with the nodes and name the intended inputs, widget values laid out as the
editor (frontend 1.58) lays them out, UUID ids, the template shape, one source for the sizes,
and UI and API twins that describe the same graph (the generator, the client's conversion and
`h3-multigpu submit --check` all give the bundled API file)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import uuid
from pathlib import Path

import pytest
from fake_comfy_server import FakeComfyServer
from workflow_bed import (
    ACCEPTED,
    BUILT_FROM,
    REFUSED,
    RELEASES,
    saved_schemas,
    schema_essence,
    served_release,
    with_files,
)

from h3_multigpu import nodes
from h3_multigpu.cli import main as cli_main
from h3_multigpu.client import editor, ui_to_api
from h3_multigpu.client.validate import check_prompt, review_prompt
from h3_multigpu.common import geometry
from h3_multigpu.nodes import inputs

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
LAYOUT = ROOT / "dev" / "workflow_layout"  # the layout engine that writes WORKFLOWS
DATA = Path(__file__).resolve().parent / "data"
# the project's shared/ folder sits beside the checkout (CI lays a copy there too)
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "reference" / "templates"
KINDS = ("t2v", "i2v", "r2v")
NAMES = tuple(f"h3_multigpu_two_pass_{k}" for k in KINDS)
TITLES = ("Prompt", "Seconds", "Seed", "PASS1 Width", "PASS1 Height", "PASS2 Width",
          "PASS2 Height", "PASS1 Steps", "PASS2 Steps", "Turbo LoRA", "Save Video")

CORE = json.loads((DATA / "object_info_h3.json").read_text())["served"]
PACK = json.loads((DATA / "object_info_pack.json").read_text())["served"]
SCHEMAS = {**CORE, **PACK}
EDITOR_ONLY = ("MarkdownNote", "Note")


def _builder():
    spec = importlib.util.spec_from_file_location("build_workflows",
                                                  LAYOUT / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> tuple[dict, dict]:
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    api = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    return ui, api


def _graphs(ui: dict) -> list[tuple[str, dict, dict[int, tuple]]]:
    """(label, graph, {link id: (origin, origin slot, target, target slot, type)})."""
    out = []
    root_links = {link[0]: tuple(link[1:6]) for link in ui["links"]}
    out.append(("root", ui, root_links))
    for sub in ui["definitions"]["subgraphs"]:
        links = {link["id"]: (link["origin_id"], link["origin_slot"], link["target_id"],
                              link["target_slot"], link["type"]) for link in sub["links"]}
        out.append((sub["name"], sub, links))
    return out


def _subgraph_ids(ui: dict) -> set[str]:
    return {sub["id"] for sub in ui["definitions"]["subgraphs"]}


def served_with_files(release: str = BUILT_FROM) -> dict:
    """The served schemas as a server with the workflows' model files and images installed."""
    return with_files(saved_schemas(release))


@pytest.fixture(params=NAMES)
def workflow(request):
    return request.param, *_load(request.param)


def test_files_are_what_the_generator_writes(workflow):
    name, _, _ = workflow
    builder = _builder()
    built_ui, built_api = builder.build_all()[name]
    assert (WORKFLOWS / f"{name}.json").read_text() == builder.dump_ui(built_ui), \
        "run: python dev/workflow_layout/build_workflows.py"
    assert (WORKFLOWS / "api" / f"{name}.json").read_text() == builder.dump_api(built_api)


def test_ids_are_uuids_as_the_editor_validator_requires(workflow):
    _, ui, _ = workflow
    ids = [ui["id"]]
    for sub in ui["definitions"]["subgraphs"]:
        ids += [sub["id"], *(slot["id"] for slot in sub["inputs"] + sub["outputs"])]
    for value in ids:
        assert str(uuid.UUID(value)) == value, f"{value!r} is not a UUID"
    assert len(set(ids)) == len(ids)
    instances = [n for n in ui["nodes"] if n["type"] in _subgraph_ids(ui)]
    assert len(instances) == 1


def test_link_records_agree_with_the_nodes(workflow):
    """What the editor's link fixer checks: every record's target slot carries that link and
    its origin output lists it; no input or output names a link that does not exist."""
    _, ui, _ = workflow
    all_ids = []
    for label, graph, links in _graphs(ui):
        by_id = {n["id"]: n for n in graph["nodes"]}
        all_ids += list(links)
        for link_id, (origin, origin_slot, target, target_slot, _kind) in links.items():
            if target == -20:
                assert link_id in graph["outputs"][target_slot]["linkIds"], (label, link_id)
            else:
                slot = by_id[target]["inputs"][target_slot]
                assert slot["link"] == link_id, (
                    f"{label}: link {link_id} names slot {target_slot} ({slot['name']}) of "
                    f"node {target}, which carries link {slot['link']}")
            if origin == -10:
                assert link_id in graph["inputs"][origin_slot]["linkIds"], (label, link_id)
            else:
                assert link_id in (by_id[origin]["outputs"][origin_slot]["links"] or [])
        for node in graph["nodes"]:
            for slot in node.get("inputs") or []:
                assert slot["link"] is None or slot["link"] in links, (label, node["id"])
            for out in node.get("outputs") or []:
                assert all(link in links for link in out["links"] or []), (label, node["id"])
    assert len(all_ids) == len(set(all_ids)) and max(all_ids) == ui["last_link_id"]


def _types_meet(sent: str, accepted: str) -> bool:
    return bool({t.strip() for t in sent.split(",")} & {t.strip() for t in accepted.split(",")})


def test_every_link_reaches_its_intended_input_by_name(workflow):
    """The generator's description (which input each wire feeds) against the written link
    records: the slot a record names is that input, and the types are the served ones."""
    name, ui, _ = workflow
    wf = _builder().two_pass(name.rsplit("_", 1)[1])
    wf.ui()
    records = {}
    for _label, graph, links in _graphs(ui):
        by_id = {n["id"]: n for n in graph["nodes"]}
        for link_id, (origin, origin_slot, target, target_slot, kind) in links.items():
            records[link_id] = (by_id.get(target), target_slot, by_id.get(origin), origin_slot,
                                kind)
    checked = 0
    for graph in [wf.root, *wf.subgraphs]:
        for _src, _out, target, input_name in wf._edges(graph):
            node, slot, origin, origin_slot, kind = records[wf._link_id(target, input_name)]
            if node is None:  # into the subgraph's output node
                continue
            assert node["inputs"][slot]["name"] == input_name, (node["title"], input_name)
            if origin is not None and node["type"] in SCHEMAS and origin["type"] in SCHEMAS:
                sent = SCHEMAS[origin["type"]]["output"][origin_slot]
                spec = editor.declared_inputs(SCHEMAS[node["type"]])
                wanted = {n: (k if not isinstance(k, list) else "COMBO") for n, k, *_ in spec}
                accepted = wanted.get(input_name) or editor.autogrow_type(dict(
                    next(o for n, k, o, _ in spec if input_name.startswith(n + "."))))
                assert sent == kind and _types_meet(sent, accepted), (input_name, sent)
            checked += 1
    assert checked >= 50


def test_widget_values_are_laid_out_as_the_editor_does(workflow):
    """widgets_values has one value per widget the served schema gives (DynamicCombo options,
    control and upload widgets included), named the same in widgets_values_named."""
    _, ui, _ = workflow
    subgraphs = _subgraph_ids(ui)
    for label, graph, _ in _graphs(ui):
        for node in graph["nodes"]:
            kind = node["type"]
            if kind in EDITOR_ONLY:
                assert len(node["widgets_values"]) == 1
                continue
            if kind in subgraphs:
                promoted = [s["name"] for s in node["inputs"] if s.get("widget")]
                assert list(node["widgets_values_named"]) == promoted
                assert node["widgets_values"] == list(node["widgets_values_named"].values())
                continue
            info = SCHEMAS[kind]
            named = node.get("widgets_values_named", {})
            layout = editor.widgets(info, named)
            assert [w.name for w in layout] == list(named), (label, node["title"])
            assert node.get("widgets_values", []) == list(named.values()), node["title"]
            values = editor.widget_values_by_input(info, node.get("widgets_values", []))
            linked = {s["name"] for s in node["inputs"] if s["link"] is not None}
            for widget in layout:
                if widget.input is None or widget.input in linked:
                    continue
                value = values[widget.input]
                options = editor.combo_keys(widget.options) if widget.kind == \
                    editor.DYNAMIC_COMBO else widget.options.get("options") or (
                    widget.kind if isinstance(widget.kind, list) else None)
                if options and widget.input not in ("unet_name", "clip_name", "vae_name",
                                                     "lora_name", "image", "upscaler_name"):
                    assert value in options, (node["title"], widget.input, value)
                low, high = widget.options.get("min"), widget.options.get("max")
                if low is not None:
                    assert low <= value <= high, (node["title"], widget.input, value)


def test_the_known_widget_layouts_of_save_and_create_video():
    """The defects seen in the frontend: CreateVideo has 4 widgets upstream, SaveVideo's
    format is a DynamicCombo whose codec follows it, and its hidden codec is still a widget.
    0.33.0 has the first two of CreateVideo's and a plain format combo with a codec after it,
    so the files' first values serve both."""
    assert [w.name for w in editor.widgets(CORE["CreateVideo"])] == [
        "fps", "bit_depth", "color_space", "codec"]
    save = editor.widgets(CORE["SaveVideo"], {"format": "auto"})
    assert [w.name for w in save] == ["filename_prefix", "format", "format.codec", "codec"]
    assert [w.name for w in editor.widgets(CORE_033["CreateVideo"])] == ["fps", "bit_depth"]
    assert [w.name for w in editor.widgets(CORE_033["SaveVideo"], {"codec": "auto"})] == [
        "filename_prefix", "format", "codec"]
    assert [s.name for s in editor.slots(CORE["SaveVideo"])] == [
        "video", "filename_prefix", "format", "format.codec", "codec"]
    r2v = editor.slots(CORE["MiniMaxH3ReferenceToVideo"],
                       connected={"ref_images.ref_image_0", "ref_images.ref_image_1"})
    assert [s.name for s in r2v][:6] == ["clip", "vae", "audio_vae", "ref_images.ref_image_0",
                                         "ref_images.ref_image_1", "ref_images.ref_image_2"]
    assert [w.name for w in editor.widgets(CORE["RandomNoise"])] == [
        "noise_seed", "control_after_generate"]
    assert [w.name for w in editor.widgets(CORE["LoadImage"])] == ["image", "upload"]


def test_shaped_like_the_official_templates(workflow):
    name, ui, api = workflow
    top = ui["nodes"]
    assert len(top) <= 10, [n["type"] for n in top]
    kinds = [n["type"] for n in top]
    note = next(n for n in top if n["type"] == "MarkdownNote")["widgets_values"][0]
    for needle in ("H3 Multi-GPU", "models/diffusion_models/", "gpu:0", "gpu:1",
                   "MiniMaxH3LatentUpscaleWithModel"):
        assert needle in note, needle
    assert "SaveVideo" in kinds and "H3MultiGPUShowText" in kinds
    (sub,) = ui["definitions"]["subgraphs"]
    promoted = [s["name"] for s in sub["inputs"] if s["name"] in ("prompt", "seconds", "seed")]
    assert promoted == ["prompt", "seconds", "seed"]
    sockets = [s["name"] for s in sub["inputs"] if s["type"] == "IMAGE"]
    assert sockets == {"t2v": [], "i2v": ["first_frame"],
                       "r2v": ["reference_1", "reference_2"]}[name.rsplit("_", 1)[1]]
    assert kinds.count("LoadImage") == len(sockets)
    groups = [g["title"] for g in sub["groups"]]
    for stage in ("gpu:0 text encoder", "gpu:1 PASS1", "gpu:0 latent upscale", "gpu:1 PASS2",
                  "gpu:0 decode"):
        assert any(g.startswith(stage) for g in groups), stage
    assert not any(n["class_type"] == "MiniMaxH3LatentUpscaleWithModel" for n in api.values())


def _by_title(api: dict) -> dict:
    return {n["_meta"]["title"]: (node_id, n) for node_id, n in api.items()}


def test_one_source_for_the_sizes(workflow):
    """PASS1 and PASS2 sizes live in four nodes that feed the placement (its plan), PASS1,
    the upscale; no other node carries a literal size."""
    _, _, api = workflow
    t = _by_title(api)
    size_ids = {t[k][0] for k in ("PASS1 Width", "PASS1 Height", "PASS2 Width", "PASS2 Height")}
    value = {k: t[k][1]["inputs"]["value"] for k in
             ("PASS1 Width", "PASS1 Height", "PASS2 Width", "PASS2 Height")}
    assert (value["PASS1 Width"], value["PASS1 Height"]) == (864, 480)
    assert (value["PASS2 Width"], value["PASS2 Height"]) == (1312, 736)  # not 1.5x = 1280x704
    assert inputs.check_two_pass(*value.values()) is None
    place, cond, upscale = (t[k][1] for k in ("Multi-GPU Placement", "PASS1 Conditioning",
                                               "Latent Upscale"))
    wiring = [(place, "pass1_width", "PASS1 Width"), (place, "pass1_height", "PASS1 Height"),
              (place, "pass2_width", "PASS2 Width"), (place, "pass2_height", "PASS2 Height"),
              (cond, "width", "PASS1 Width"), (cond, "height", "PASS1 Height"),
              (upscale, "width", "PASS2 Width"), (upscale, "height", "PASS2 Height")]
    for node, name, title in wiring:
        assert node["inputs"][name] == [t[title][0], 0], f"{name} not from {title}"
    for node_id, node in api.items():
        for name, value in node["inputs"].items():
            if "width" in name or "height" in name:
                assert node_id in size_ids or isinstance(value, list), (node_id, name)
    seconds_id = t["Seconds"][0]
    assert cond["inputs"]["length"] == [seconds_id, 0]  # frames
    assert place["inputs"]["seconds"] == [seconds_id, 1]  # the clip's real length
    frames, _ = inputs.seconds_to_frames(t["Seconds"][1]["inputs"]["seconds"])
    assert geometry.validate_frames(frames) == 124


def test_the_ui_file_converts_to_exactly_the_api_file(workflow):
    name, ui, api = workflow
    converted = ui_to_api(ui, SCHEMAS)
    assert converted == api
    assert json.dumps(converted, indent=2) + "\n" == (WORKFLOWS / "api" / f"{name}.json"
                                                      ).read_text()


def test_submit_check_prints_exactly_the_bundled_api_graph(workflow):
    name, _, _ = workflow
    out = io.StringIO()
    with FakeComfyServer(object_info=served_with_files()) as fake, \
            contextlib.redirect_stdout(out):
        code = cli_main(["submit", str(WORKFLOWS / f"{name}.json"), "--server", fake.url,
                         "--check"])
    assert code == 0
    assert out.getvalue() == (WORKFLOWS / "api" / f"{name}.json").read_text()


def test_the_client_finds_nothing_to_fix(workflow):
    _, _, api = workflow
    assert check_prompt(api, served_with_files()) == []
    # Without the model files the client names each one, as the server would.
    problems = check_prompt(api, SCHEMAS)
    assert problems and all("not offered by the server" in p.message for p in problems)


# -------------------------------------------------------------------------------------------
# One set of files for ComfyUI 0.33.0 and the newest files
# -------------------------------------------------------------------------------------------

CORE_033 = json.loads((DATA / "object_info_033.json").read_text())["served"]
# API inputs of the newest schemas that 0.33.0 does not declare (its server ignores them)
ONLY_NEWEST = {"CreateVideo": {"color_space", "codec"}, "SaveVideo": {"format.codec"}}


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_file_validates_on_every_release(workflow, release):
    """The UI file, converted as that release's editor converts it, and the API twin both pass
    the server's checks on ComfyUI 0.33.0 and on the newest files; what 0.33.0 lacks of the
    twin is exactly the inputs it ignores, and the client says so."""
    _, ui, api = workflow
    info = served_with_files(release)
    converted = ui_to_api(ui, info)
    assert check_prompt(converted, info) == []
    review = review_prompt(api, info)
    assert review.problems == []
    ignored = {} if release == BUILT_FROM else ONLY_NEWEST
    twin_less = {i: {**n, "inputs": {k: v for k, v in n["inputs"].items()
                                     if k not in ignored.get(n["class_type"], ())}}
                 for i, n in api.items()}
    assert converted == twin_less
    noted = {p.where.rsplit("(", 1)[1].rstrip(")") for p in review.notes}
    assert noted == set(ignored)


def test_0_33_refuses_what_the_old_files_carried():
    """The defect: CreateVideo bit_depth 'auto' (what the files had) is an INT on 0.33.0."""
    _, api = _load("h3_multigpu_two_pass_t2v")
    video = next(n for n in api.values() if n["class_type"] == "CreateVideo")
    video["inputs"]["bit_depth"] = "auto"
    problems = " ".join(str(p) for p in check_prompt(api, served_with_files("0.33.0")))
    assert "'bit_depth' = 'auto' is not an INT" in problems
    assert check_prompt(api, served_with_files("newest")) == []  # an option there


@pytest.mark.parametrize("release", list(RELEASES))
def test_submit_check_of_the_ui_file_prints_what_that_release_queues(workflow, release):
    name, ui, _ = workflow
    out = io.StringIO()
    with FakeComfyServer(object_info=served_with_files(release)) as fake, \
            contextlib.redirect_stdout(out):
        code = cli_main(["submit", str(WORKFLOWS / f"{name}.json"), "--server", fake.url,
                         "--check"])
    assert code == 0
    assert json.loads(out.getvalue()) == ui_to_api(ui, served_with_files(release))


@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize("edit", REFUSED, ids=repr)
def test_the_client_refuses_what_the_server_refuses(edit, release):
    """One bad value per way the server checks an input (tests/workflow_bed.py; the same table
    runs against a real server in test_workflows_comfyui.py)."""
    _, api = _load("h3_multigpu_two_pass_t2v")
    node_id = edit.apply(api)
    problems = check_prompt(api, served_with_files(release))
    assert len(problems) == 1 and problems[0].where.startswith(f"node #{node_id} "), problems
    assert f"'{edit.name}'" in problems[0].message


@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize("edit", ACCEPTED, ids=repr)
def test_the_client_accepts_what_the_server_accepts(edit, release):
    _, api = _load("h3_multigpu_two_pass_t2v")
    edit.apply(api)
    assert check_prompt(api, served_with_files(release)) == []


def test_what_the_server_ignores_or_changes_is_a_note_not_a_refusal():
    _, api = _load("h3_multigpu_two_pass_t2v")
    info = served_with_files()
    t = _by_title(api)
    t["Seed"][1]["inputs"]["value"] = 7.5  # the server truncates it to 7
    t["PASS1 Steps"][1]["inputs"]["value"] = "8"
    review = review_prompt(api, info)
    assert review.problems == []
    notes = " ".join(str(n) for n in review.notes)
    assert "truncates it to 7" in notes and "reads the text as 8" in notes
    # A node that feeds no output is neither checked nor run by the server.
    api["99"] = {"class_type": "BasicScheduler", "_meta": {"title": "Spare"},
                 "inputs": {"model": [t["Multi-GPU Placement"][0], 0],
                            "scheduler": "simple", "steps": 0, "denoise": 1.0}}
    review = review_prompt(api, info)
    assert review.problems == []
    assert any("feeds no output node" in str(n) for n in review.notes)


def test_a_dynamic_combo_key_not_offered_is_refused_before_the_run():
    """Stricter than the server on purpose: it queues such a key and the node fails when it
    runs."""
    _, api = _load("h3_multigpu_two_pass_t2v")
    _by_title(api)["Save Video"][1]["inputs"]["codec"] = "vp9"
    for release in RELEASES:
        assert "'codec' = 'vp9' is not offered" in str(check_prompt(
            api, served_with_files(release)))


def test_schema_comparisons_keep_what_matters_and_ignore_what_releases_add():
    newest, old = saved_schemas("newest"), saved_schemas("0.33.0")
    assert "dev_only" in CORE_033["BasicGuider"] and "dev_only" not in CORE["BasicGuider"]
    for same in ("BasicGuider", "BasicScheduler", "SamplerCustomAdvanced", "PrimitiveInt",
                 "UNETLoader", "VAEDecodeAudio"):
        assert schema_essence(newest[same]) == schema_essence(old[same]), same
    for changed in ("CreateVideo", "SaveVideo", "MiniMaxH3ReferenceToVideo"):
        assert schema_essence(newest[changed]) != schema_essence(old[changed]), changed
    assert served_release(newest)[0] == "newest" and served_release(old)[0] == "0.33.0"
    grown = json.loads(json.dumps(newest))
    grown["KSamplerSelect"]["input"]["required"]["sampler_name"][0].append("euler_v2")
    grown["KSamplerSelect"]["essentials_category"] = "sampling"
    assert served_release(grown)[0] == "newest"


def test_every_node_has_a_unique_title_and_the_client_titles_exist(workflow):
    _, _, api = workflow
    titles = [n["_meta"]["title"] for n in api.values()]
    assert all(t.strip() for t in titles) and len(titles) == len(set(titles))
    by_title = _by_title(api)
    for title in TITLES:
        assert title in by_title, f"missing node titled {title!r}"
    assert by_title["Save Video"][1]["class_type"] == "SaveVideo"
    assert by_title["Turbo LoRA"][1]["class_type"] == "LoraLoaderModelOnly"
    assert by_title["Seconds"][1]["inputs"]["seconds"] == 5.0
    assert by_title["Prompt"][1]["inputs"]["value"].strip()


def test_pass2_is_a_short_renoise_of_the_upscaled_pass1(workflow):
    _, _, api = workflow
    t = _by_title(api)
    pass1, pass2 = t["PASS1 Sampler"][1], t["PASS2 Sampler"][1]
    sched1, sched2 = t["PASS1 Schedule"][1], t["PASS2 Schedule"][1]
    assert pass2["inputs"]["latent_image"] == [t["Latent Upscale"][0], 0]
    assert t["Latent Upscale"][1]["inputs"]["samples"] == [t["PASS1 Sampler"][0], 0]
    assert pass1["inputs"]["sigmas"][0] == t["PASS1 Schedule"][0]
    assert pass2["inputs"]["sigmas"][0] == t["PASS2 Schedule"][0]
    assert sched1["inputs"]["denoise"] == 1.0
    assert 0.0 < sched2["inputs"]["denoise"] <= 0.5
    steps1 = t["PASS1 Steps"][1]["inputs"]["value"]
    steps2 = t["PASS2 Steps"][1]["inputs"]["value"]
    assert sched1["inputs"]["steps"] == [t["PASS1 Steps"][0], 0]
    assert sched2["inputs"]["steps"] == [t["PASS2 Steps"][0], 0]
    assert 0 < steps2 < steps1
    # One seed for both passes; one placed model samples both (one DiT on the root GPU).
    seed = [t["Seed"][0], 0]
    assert t["PASS1 Noise"][1]["inputs"]["noise_seed"] == seed
    assert t["PASS2 Noise"][1]["inputs"]["noise_seed"] == seed
    place = t["Multi-GPU Placement"][0]
    assert sched1["inputs"]["model"] == sched2["inputs"]["model"] == [place, 0]


def test_components_come_from_the_placement_node(workflow):
    _, _, api = workflow
    t = _by_title(api)
    place = t["Multi-GPU Placement"][0]
    assert t["Decode Video"][1]["inputs"]["vae"] == [place, 2]
    assert t["Decode Audio"][1]["inputs"]["vae"] == [place, 3]
    assert t["Latent Upscale"][1]["inputs"]["model"] == [place, 4]
    assert t["Latent Upscale"][1]["class_type"] == "H3MultiGPULatentUpscale"
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


def test_reference_to_video_feeds_both_references_through_autogrow():
    _, api = _load("h3_multigpu_two_pass_r2v")
    t = _by_title(api)
    cond = t["PASS1 Conditioning"][1]
    assert cond["class_type"] == "MiniMaxH3ReferenceToVideo"
    assert cond["inputs"]["ref_images.ref_image_0"] == [t["Reference 1"][0], 0]
    assert cond["inputs"]["ref_images.ref_image_1"] == [t["Reference 2"][0], 0]
    assert "<Picture 1>" in t["Prompt"][1]["inputs"]["value"]
    assert "ref2va" in t["Diffusion Model"][1]["inputs"]["unet_name"]


def test_model_files_are_the_official_templates_names(workflow):
    if not TEMPLATES.is_dir():
        pytest.skip("official templates not present")
    _, _, api = workflow
    official = " ".join(p.read_text() for p in TEMPLATES.glob("*.json"))
    loaders = {"UNETLoader": "unet_name", "CLIPLoader": "clip_name", "VAELoader": "vae_name",
               "LoraLoaderModelOnly": "lora_name"}
    for node in api.values():
        key = loaders.get(node["class_type"])
        if key:
            assert f'"{node["inputs"][key]}"' in official, node["inputs"][key]


def test_templates_folder_is_the_one_comfyui_scans():
    # ComfyUI's custom_node_manager lists */workflows/*.json (top level only) as templates.
    assert sorted(p.stem for p in WORKFLOWS.glob("*.json")) == sorted(NAMES)
    assert sorted(p.stem for p in (WORKFLOWS / "api").glob("*.json")) == sorted(NAMES)


def test_docs_name_every_node_and_title():
    """docs/nodes.md names every node id, docs/workflows.md every title the client patches."""
    text = (ROOT / "docs" / "nodes.md").read_text()
    for node_id in nodes.NODE_IDS:
        assert f"`{node_id}`" in text, node_id
    text = (ROOT / "docs" / "workflows.md").read_text()
    for title in TITLES:
        assert f'"{title}"' in text, title


# Crossings inside each subgraph, counted between the curves the editor draws (see
# test_the_wires_cross_only_where_the_columns_force_it). order_search.py proves that no
# left-to-right drawing of the same columns has fewer than 35 / 47 / 44 (t2v / i2v / r2v).
CROSSINGS = {"t2v": 52, "i2v": 65, "r2v": 65}


def _geometry():
    _builder()  # puts dev/workflow_layout/ on the path
    import wire_geometry

    return wire_geometry


def test_the_wires_cross_only_where_the_columns_force_it(workflow):
    """Crossings between drawn wires: every link as the editor (frontend 1.58.1) draws it, a
    cubic Bezier per stretch between reroutes (a stretch shared by the wires of one output is
    one curve), sampled at 32 points; curves of one output are not compared. tests/browser/
    checks these Beziers against the ones the real editor draws. None at the top level; inside
    each subgraph the counts the layout reaches (the lower bound is in CROSSINGS' comment)."""
    name, ui, _ = workflow
    geometry = _geometry()
    assert geometry.crossings(geometry.wires(ui, SCHEMAS)) == []
    (sub,) = ui["definitions"]["subgraphs"]
    found = geometry.crossings(geometry.wires(sub, SCHEMAS))
    names = geometry.leg_names(sub)
    assert len(found) == CROSSINGS[name.rsplit("_", 1)[1]], [
        f"{names[a]} x {names[b]}" for a, b in found]


def test_no_wire_passes_behind_a_node_and_nothing_overlaps(workflow):
    """No wire runs under a node it does not connect (the editor draws wires below nodes); no
    two nodes, no two groups overlap, and no group box cuts through a node."""
    _, ui, _ = workflow
    geometry = _geometry()
    for graph in [ui, *ui["definitions"]["subgraphs"]]:
        assert geometry.overlaps(graph, SCHEMAS) == []
        boxes = geometry.Geometry(graph, SCHEMAS)
        links = {link["id"]: link for link in geometry._links(graph)}
        for wire in geometry.wires(graph, SCHEMAS):
            ends = (links[wire.id]["origin_id"], links[wire.id]["target_id"])
            points = [p for leg in wire.legs for p in geometry._sample(leg, 64)]
            for node in graph["nodes"]:
                if node["id"] in ends:
                    continue
                x0, y0, x1, y1 = boxes.box(node["id"])
                assert not any(x0 < x < x1 and y0 < y < y1 for x, y in points), (
                    wire.id, node.get("title"))


def test_reroutes_carry_exactly_the_wires_they_name(workflow):
    """Each link's parentId names the last reroute on its way; each reroute's linkIds are the
    links whose way passes it (what the editor rebuilds its reroute chains from)."""
    _, ui, _ = workflow
    (sub,) = ui["definitions"]["subgraphs"]
    reroutes = {r["id"]: r for r in sub["reroutes"]}
    through: dict[int, set[int]] = {}
    for link in sub["links"]:
        point = link.get("parentId")
        while point is not None:
            through.setdefault(point, set()).add(link["id"])
            point = reroutes[point].get("parentId")
    assert {rid: set(r["linkIds"]) for rid, r in reroutes.items()} == through
    assert sub["state"]["lastRerouteId"] == max(reroutes)
    origins = {link["id"]: (link["origin_id"], link["origin_slot"]) for link in sub["links"]}
    for r in reroutes.values():  # a reroute carries the wires of one output
        assert len({origins[i] for i in r["linkIds"]}) == 1, r


def test_documented_pictures_are_the_browser_screenshots():
    """docs/workflows.md shows every workflow's picture, the README the first; each is a PNG."""
    page = (ROOT / "docs" / "workflows.md").read_text()
    for name in NAMES:
        picture = ROOT / "docs" / "images" / f"{name}.png"
        assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture
        assert f"(images/{name}.png)" in page
    assert f"(docs/images/{NAMES[0]}.png)" in (ROOT / "README.md").read_text()


def test_the_column_orders_are_the_fewest_crossings_the_search_finds():
    """dev/workflow_layout/subgraph_columns.py is what order_search.py writes: its exact integer
    program still finds the recorded least number of crossings for these columns."""
    pytest.importorskip("scipy")
    _builder()
    import order_search
    import subgraph_columns

    for kind in KINDS:
        crossings, columns = order_search.search(kind)
        assert crossings == subgraph_columns.LAYERED[kind], kind
        assert {tuple(c) for c in columns} == {tuple(c) for c in subgraph_columns.COLUMNS[kind]}
