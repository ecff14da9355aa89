"""CPU tests of the nodes' plain logic: device names, placement, input checks, status text,
the attention override and the ComfyUI-side placement fallbacks (on the twin, no ComfyUI)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from twin import TwinPatcher

# Imported, never skipped: check_options answers None for a library missing from the
# install, which would let these tests pass without it.
from h3_multigpu import (
    chunking,
    nodes,
    offload,  # noqa: F401
)
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.nodes import comfy_placement, inputs
from h3_multigpu.nodes.devices import (
    GiB,
    GpuInfo,
    check_index,
    describe_index,
    device_option,
    parse_device,
    parse_device_list,
)
from h3_multigpu.nodes.features import apply_plan, check_options, plan_feature_strings
from h3_multigpu.nodes.placement import (
    decide_placement,
    placement_from_plan,
    should_release_text_encoder,
)
from h3_multigpu.nodes.status import comfyui_support_line, compose_status, feature_lines

ROOT = Path(__file__).resolve().parents[1]
PAIR = [GpuInfo(0, "NVIDIA GeForce RTX 5060 Ti", 16 * GiB),
        GpuInfo(1, "NVIDIA GeForce RTX 5060 Ti", 16 * GiB)]


def _planner():
    from h3_multigpu.nodes.planning import make_plan

    return make_plan


def _plan(profile: str, seconds: float = 5.0, lora_rank: int = 128):
    return _planner()(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                      seconds=seconds, devices=profile, lora_rank=lora_rank)


# ---------------------------------------------------------------------- device names
@pytest.mark.parametrize("text,expected", [
    ("gpu:1", 1), ("GPU:0", 0), (" cuda:2 ", 2), ("3", 3), ("auto", "auto"),
    ("default", "auto"), ("cpu", "cpu")])
def test_parse_device_accepts_comfyui_names(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu1", "gpu:-1", "nvidia", "gpu:one", "1.5"])
def test_parse_device_refuses_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="gpu:N"):
        parse_device(text)


def test_device_list_and_index_checks():
    assert parse_device_list("gpu:0, gpu:2") == [0, 2]
    assert parse_device_list("auto") == "auto"
    with pytest.raises(ValueError, match="twice"):
        parse_device_list("gpu:0,gpu:0")
    with pytest.raises(ValueError, match="not a GPU"):
        parse_device_list("gpu:0,cpu")
    assert check_index(1, PAIR, "root") is None
    message = check_index(2, PAIR, "root")
    assert "gpu:2 does not exist" in message
    assert "gpu:1 NVIDIA GeForce RTX 5060 Ti 16 GiB" in message
    with pytest.raises(ValueError):
        device_option(-1)


def test_gpu_is_named_by_index_model_and_memory():
    assert PAIR[1].describe() == "gpu:1 NVIDIA GeForce RTX 5060 Ti 16 GiB"
    assert describe_index(1, PAIR) == "gpu:1 NVIDIA GeForce RTX 5060 Ti 16 GiB"
    assert describe_index(3, PAIR) == "gpu:3"
    assert describe_index(None, PAIR) == "cpu"


# ---------------------------------------------------------------------- placement
def test_two_gpus_put_the_dit_on_gpu1_and_the_rest_on_gpu0():
    placement = decide_placement(PAIR)
    assert (placement.root, placement.helper, placement.multi_gpu) == (1, 0, True)
    assert placement.device_of("dit") == 1
    assert all(placement.device_of(c) == 0 for c in
               ("text_encoder", "video_vae", "audio_vae", "latent_upscaler"))
    assert not placement.degraded
    lines = "\n".join(placement.lines())
    assert "DiT + sampler (root): gpu:1 NVIDIA GeForce RTX 5060 Ti 16 GiB" in lines
    assert "(helper): gpu:0 NVIDIA GeForce RTX 5060 Ti 16 GiB" in lines


def test_missing_second_gpu_degrades_to_one_and_says_so():
    placement = decide_placement(PAIR[:1], root=1, helper=0)
    assert (placement.root, placement.helper, placement.multi_gpu) == (0, 0, False)
    assert placement.degraded
    assert "only one GPU (gpu:0 NVIDIA GeForce RTX 5060 Ti 16 GiB)" in placement.notes[0]
    assert "Dual-Sage is off" in placement.notes[0]
    none = decide_placement([])
    assert none.root is None and "no GPU" in none.notes[0]


def test_indices_past_the_machine_and_equal_roles_are_repaired_with_notes():
    placement = decide_placement(PAIR, root=5, helper=1)
    assert (placement.root, placement.helper) == (1, 0)
    assert any("root gpu:5 does not exist" in n for n in placement.notes)
    assert any("helper moved" in n for n in placement.notes)
    with pytest.raises(ValueError, match="unknown component"):
        placement.device_of("sampler")


def test_placement_follows_the_plan():
    plan = _plan("2xR9700")
    placement = placement_from_plan(plan, PAIR)
    assert placement.root == plan.root_device == 1
    assert placement.helper == plan.helper_devices[0] == 0


# ---------------------------------------------------------------------- releasing the text encoder
def test_release_modes():
    assert should_release_text_encoder("always")[0] is True
    assert should_release_text_encoder("never")[0] is False
    assert should_release_text_encoder("auto")[0] is True  # no plan: be safe
    single = decide_placement(PAIR[:1])
    released, why = should_release_text_encoder("auto", None, single)
    assert released and "shares its GPU" in why
    with pytest.raises(ValueError, match="auto"):
        should_release_text_encoder("sometimes")


def test_release_follows_the_helper_memory_the_plan_predicts():
    small = _plan("2x3060")  # 12 GiB helper: a 14.6 GB text encoder cannot stay
    released, why = should_release_text_encoder("auto", small, placement_from_plan(small, PAIR))
    assert released and "released after encoding" in why
    big = _plan("2xH200")  # 141 GB helper: everything fits beside it
    kept, why = should_release_text_encoder("auto", big, placement_from_plan(big, PAIR))
    assert not kept and "kept on gpu:0" in why


# ---------------------------------------------------------------------- inputs
def test_two_pass_sizes_are_checked_with_the_fix_in_the_message():
    assert inputs.check_two_pass(864, 480, 1312, 736) is None
    message = inputs.check_two_pass(864, 480, 1296, 720)
    assert message.startswith("PASS2: canvas 1296x720 is not valid")
    fixed = re.search(r"use (\d+)x(\d+)", message)
    assert inputs.check_canvas(int(fixed[1]), int(fixed[2]), "fix") is None
    assert "smaller than PASS1" in inputs.check_two_pass(1312, 736, 864, 480)
    assert inputs.first_message(None, None) is True
    assert inputs.first_message(None, "bad") == "bad"


@pytest.mark.parametrize("seconds,frames", [(5, 124), (10, 243), (12, 294), (15, 362)])
def test_seconds_snap_to_the_frame_grid(seconds, frames):
    got, real = inputs.seconds_to_frames(seconds)
    assert got == frames and real == pytest.approx(frames / 24)
    assert inputs.seconds_to_frames(real)[0] == frames  # the node's real-length output is stable
    assert inputs.check_seconds(0) is not None


def test_latent_frames_invert_exactly():
    from h3_multigpu.common import geometry

    for frames in range(5, 600, 17):
        assert inputs.frames_for_latent(geometry.latent_frames(frames)) == frames
    with pytest.raises(ValueError, match="2 \\+ 5k"):
        inputs.frames_for_latent(8)


def test_split_and_auto_int_strings():
    assert inputs.parse_split("28:28") == (28, 28)
    assert inputs.parse_split("auto") == "auto"
    with pytest.raises(ValueError, match="56"):
        inputs.parse_split("28:20")
    with pytest.raises(ValueError, match="positive"):
        inputs.parse_split("56")
    assert inputs.parse_auto_int("12", "ffn_chunk") == 12
    assert inputs.parse_auto_int("auto", "ffn_chunk") == "auto"
    assert "at least" in inputs.check_auto_int("-1", "ffn_chunk")
    assert inputs.check_profile("2xR9700", ["2xR9700"]) is None
    assert "use 'auto'" in inputs.check_profile("2xR9800", ["2xR9700"])


# ---------------------------------------------------------------------- status
def test_status_names_every_feature_device_and_degradation():
    placement = decide_placement(PAIR[:1], root=1, helper=0)
    features = {"dual_sage": "off: only one GPU is in use here", "chunking": "ffn 8192 tokens",
                "prefetch": "NOT ACTIVE: offload is not available"}
    text = compose_status(placement=placement, features=features,
                          component_notes=["DiT -> gpu:0 (already there)"])
    assert text.startswith("H3 Multi-GPU: active on 1 GPU")
    for expected in ("one device for everything: gpu:0 NVIDIA GeForce RTX 5060 Ti 16 GiB",
                     "dual_sage: off: only one GPU", "chunking: ffn 8192 tokens",
                     "prefetch: NOT ACTIVE", "note: only one GPU", "predicted peak: no plan"):
        assert expected in text


def test_status_reports_the_plans_peaks_per_gpu():
    plan = _plan("2xR9700", seconds=12)
    text = compose_status(placement=placement_from_plan(plan, PAIR), plan=plan)
    # a plan for a profile says so: its peaks are the profile's GPUs, not this machine's
    assert "plan for profile 2xR9700 (AMD Radeon AI PRO R9700 32 GiB, " in text
    assert "not this machine (fits)" in text
    peaks = re.findall(r"predicted peak profile 2xR9700 gpu:(\d) ([\d.]+) of ([\d.]+) GiB", text)
    assert {p[0] for p in peaks} == {"0", "1"}
    for index, peak, capacity in peaks:
        gpu = next(g for g in plan.gpus if g.index == int(index))
        assert float(peak) == pytest.approx(gpu.peak_bytes / GiB, abs=0.05)
        assert float(capacity) == pytest.approx(gpu.capacity_bytes / GiB, abs=0.05)


def test_status_lines_recorded_on_a_clone_stay_on_the_clone(tiny_twin):
    base = TwinPatcher(tiny_twin)
    clone = base.clone()
    protocol.record_status(clone, "attention", "backend sdpa")
    assert feature_lines(clone) == {"attention": "backend sdpa"}
    assert feature_lines(base) == {}


# ---------------------------------------------------------------------- features from a plan
def test_plan_feature_strings_are_what_the_configs_parse():
    plan = _plan("2xR9700", seconds=15)
    wanted = plan_feature_strings(plan)
    dual = wanted["dual_sage"]
    if isinstance(dual, dict):
        assert sum(inputs.parse_split(dual["split"])) == 56
        assert parse_device_list(dual["helpers"]) == list(plan.dual_sage.helper_devices)
        assert dual["backend"] == "comfyui"  # ComfyUI's own attention, sharded: exact
    else:
        assert dual.startswith("off:")
    for name in ("chunking", "prefetch"):
        value = wanted[name]
        if isinstance(value, dict):
            assert all(isinstance(v, str) and v for v in value.values())
        else:
            assert value.startswith("off:")


def test_switched_off_features_leave_the_model_untouched(tiny_twin):
    plan = _plan("2xH200")
    model = TwinPatcher(tiny_twin)
    out, lines = apply_plan(model, plan, decide_placement(PAIR),
                            disabled=("dual_sage", "chunking", "prefetch", "sequence"))
    assert out is model
    assert set(lines.values()) == {"off: switched off on the node"}
    single, lines = apply_plan(model, plan, decide_placement(PAIR[:1]),
                               disabled=("chunking", "prefetch"))
    assert single is model
    assert lines["dual_sage"].startswith("off:")


# ---------------------------------------------------------------------- attention override
def test_backend_override_matches_the_default_attention_and_chains(tiny_twin, tiny_inputs):
    from h3_multigpu.nodes.attention_override import OVERRIDE_KEY, apply_backend_override

    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    calls = []

    def previous(func, q, k, v, heads, **kwargs):
        calls.append(func)
        return func(q, k, v, heads, **kwargs)

    base = TwinPatcher(tiny_twin)
    base.set_model_optimized_attention(previous)
    patched = apply_backend_override(base, "sdpa")
    out = patched.apply_model(*tiny_inputs)
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], plain[1], rtol=0, atol=1e-6)
    assert len(calls) == 4  # refiner + 3 blocks, each through the previous override ...
    # ... which received our kernel as func
    assert all(c.backend.name == "sdpa" for c in calls)
    assert base.model_options["transformer_options"][OVERRIDE_KEY] is previous
    assert "chained" in feature_lines(patched)["attention"]
    with pytest.raises(ValueError, match="unknown attention backend"):
        apply_backend_override(base, "no_such_kernel")


# ---------------------------------------------------------------------- placement without ComfyUI
class _VAE:
    def __init__(self, patcher):
        self.patcher = patcher
        self.first_stage_model = patcher.model
        self.device = patcher.load_device


class _Upscaler:
    def __init__(self, patcher):
        self.patcher = patcher
        self.load_device = patcher.load_device


@pytest.mark.skipif(importlib.util.find_spec("comfy") is not None,
                    reason="checks the fallback taken when ComfyUI is absent")
def test_fallback_placement_retargets_clones_and_leaves_inputs_alone(tiny_twin):
    gpu1 = torch.device("cuda", 1)
    model = TwinPatcher(tiny_twin)
    placed, note = comfy_placement.place_model(model, 1)
    assert placed is not model and placed.load_device == gpu1
    assert model.load_device == torch.device("cpu")
    assert note.startswith("DiT -> gpu:1 (load_device set on a clone")

    vae = _VAE(TwinPatcher(tiny_twin))
    placed_vae, note = comfy_placement.place_vae(vae, 0, "audio VAE")
    assert placed_vae.device == torch.device("cuda", 0) and vae.device == torch.device("cpu")
    assert placed_vae.patcher.load_device == torch.device("cuda", 0)
    assert note.startswith("audio VAE -> gpu:0")

    upscaler = _Upscaler(TwinPatcher(tiny_twin))
    placed_up, note = comfy_placement.place_upscaler(upscaler, 0)
    assert placed_up.load_device == torch.device("cuda", 0)
    assert upscaler.load_device == torch.device("cpu")
    assert "latent upscaler -> gpu:0" in note
    same, note = comfy_placement.place_upscaler(object(), 0)
    assert "has no device to set" in note

    clip = copy.copy(vae)
    assert "not importable" in comfy_placement.release_text_encoder(clip)


def test_deepclone_is_preferred_and_its_refusal_is_reported(tiny_twin):
    class Reloadable(TwinPatcher):
        def deepclone_multigpu(self, new_load_device=None):
            clone = self.clone()
            clone.load_device = new_load_device
            clone.fresh = True
            return clone

    class NoFactory(TwinPatcher):
        def deepclone_multigpu(self, new_load_device=None):
            raise RuntimeError("no cached_patcher_init")

    gpu1 = torch.device("cuda", 1)
    placed, how = comfy_placement.retarget_patcher(Reloadable(tiny_twin), gpu1)
    assert placed.fresh and how == "deepclone_multigpu"
    placed, how = comfy_placement.retarget_patcher(NoFactory(tiny_twin), gpu1)
    assert placed.load_device == gpu1 and "deepclone_multigpu refused" in how


# ---------------------------------------------------------------------- the node modules
def test_node_ids_match_the_v3_sources():
    found = set()
    for path in (ROOT / "nodes").glob("v3_*.py"):
        found |= set(re.findall(r'node_id\s*=\s*"(H3MultiGPU\w*)"', path.read_text()))
    assert found == set(nodes.NODE_IDS)
    assert len(nodes.NODE_IDS) == len(set(nodes.NODE_IDS))


def test_package_imports_without_comfyui_and_the_extension_needs_it():
    if importlib.util.find_spec("comfy_api") is not None:
        pytest.skip("ComfyUI is importable here")
    with pytest.raises(ImportError):
        nodes.H3MultiGPUExtension  # noqa: B018
    import h3_multigpu

    assert not hasattr(h3_multigpu, "comfy_entrypoint")


# ------------------------------------------------------ the libraries behind the nodes
def test_plan_chunking_is_applied_exactly_on_the_twin(tiny_twin, tiny_inputs):
    plan = _plan("2x5060Ti", seconds=15)
    assert plan.chunking.ffn_chunk > 44  # the real plan's chunks exceed the tiny sequence:
    # shrink them (the plan object is what apply_plan reads) so the 44-token twin is cut
    plan.chunking = dataclasses.replace(plan.chunking, ffn_chunk=16, qkv_chunk=12, head_group=3)
    model = TwinPatcher(tiny_twin)
    out, lines = apply_plan(model, plan, decide_placement(PAIR),
                            disabled=("dual_sage", "sequence"))
    assert out is not model and lines["chunking"].startswith("on")
    assert "16" in lines["chunking"]
    rows = {"fc1": []}
    block = tiny_twin.blocks[0]
    hooks = [block.mlp.fc1.register_forward_hook(lambda m, i, o: rows["fc1"].append(len(i[0])))]
    try:
        planned = out.apply_model(*tiny_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    # S = 44 rows cut into ceil(44 / chunk) balanced chunks of at most the plan's rows
    assert sum(rows["fc1"]) == 44 and len(rows["fc1"]) == 3 and max(rows["fc1"]) <= 16
    # qkv_proj's forward ran once per 12-row chunk through the chunk wrapper
    assert chunking.get_chunking(out).chunkers[0].calls["attn.qkv_proj"] == 4
    # the same computation as the library applied directly with the plan's numbers
    direct = chunking.apply_activation_chunking(
        TwinPatcher(tiny_twin), chunking.ChunkingConfig(ffn_chunk=16, qkv_chunk=12, head_group=3))
    expected = direct.apply_model(*tiny_inputs)
    assert torch.equal(planned[0], expected[0]) and torch.equal(planned[1], expected[1])


def test_a_missing_library_is_reported_not_silent(tiny_twin, monkeypatch):
    plan = _plan("2x5060Ti", seconds=15)
    monkeypatch.setitem(sys.modules, "h3_multigpu.chunking", None)  # import now fails
    model = TwinPatcher(tiny_twin)
    out, lines = apply_plan(model, plan, decide_placement(PAIR),
                            disabled=("dual_sage", "sequence"))
    assert out is model
    assert lines["chunking"].startswith("NOT ACTIVE: chunking is not available")


def test_feature_options_are_checked_by_the_library():
    assert "not understood" in check_options("chunking", ffn_chunk="banana")
    assert check_options("chunking", ffn_chunk="off") is None
    assert check_options("chunking", ffn_chunk=None) is None  # a link: checked at run time
    assert "resident_blocks" in check_options("prefetch", resident_blocks="many")
    assert "pinned_budget" in check_options("prefetch", resident_blocks="auto",
                                            pinned_budget="lots")


def test_sizes_in_bytes():
    assert inputs.parse_bytes("auto", "b") is None
    assert inputs.parse_bytes("24GiB", "b") == 24 * GiB
    assert inputs.parse_bytes("1.5 gb", "b") == 1_500_000_000
    assert inputs.parse_bytes(4096, "b") == 4096
    for bad in ("24 parsecs", "-1GiB", "GiB"):
        with pytest.raises(ValueError, match="24GiB"):
            inputs.parse_bytes(bad, "pinned_budget")


def test_status_says_whether_this_comfyui_runs_the_bundled_workflows():
    from h3_multigpu.nodes.server import GraphPasses

    two_pass = GraphPasses(2, "this pack's H3 Latent Upscale")
    old = comfyui_support_line({"KSampler": object}, two_pass)
    assert old.startswith("ComfyUI: NO MiniMax H3 nodes") and "update ComfyUI" in old
    assert "MiniMaxH3ImageToVideo" in old and "latent upscale: this pack's H3 Latent" in old
    h3 = comfyui_support_line({"MiniMaxH3ImageToVideo": 1, "MiniMaxH3ReferenceToVideo": 1})
    assert h3 == "ComfyUI: MiniMax H3 nodes present"
    # a one-pass graph without an upscale: no word of one
    one = comfyui_support_line({"MiniMaxH3ImageToVideo": 1, "MiniMaxH3ReferenceToVideo": 1},
                               GraphPasses(1, None))
    assert "upscale" not in one.lower()


def test_a_select_device_choice_the_placement_overrides_is_said(tiny_twin):
    """A core Select Model Device node before the pack moved the DiT to cuda:0 (it records the
    loader's device on the model); the pack places it on gpu:1 and its note says both."""
    model = TwinPatcher(tiny_twin)
    model.model._select_base_load_device = torch.device("cpu")  # the loader's device
    model.load_device = torch.device("cuda", 0)  # the Select node's choice
    placed, note = comfy_placement.place_model(model, 1)
    assert placed.load_device == torch.device("cuda", 1)
    assert "a Select Device node chose cuda:0" in note and "overrides it" in note
    agreed, note = comfy_placement.place_model(model, 0)  # the same choice: nothing to say
    assert "Select Device" not in note


def test_the_placement_note_says_where_cfg_split_runs_its_copies(tiny_twin, monkeypatch):
    """Core's MultiGPU CFG Split came first (a copy flagged for cuda:0, carried by every clone
    as ComfyUI's additional models are): the DiT's note says the pack placed its copy and
    ComfyUI's node runs the other."""
    copy = types.SimpleNamespace(load_device=torch.device("cuda", 0),
                                 is_multigpu_base_clone=True)
    monkeypatch.setattr(TwinPatcher, "get_additional_models_with_key",
                        lambda self, key: [copy] if key == "multigpu" else [], raising=False)
    _, note = comfy_placement.place_model(TwinPatcher(tiny_twin), 1)
    assert note.startswith("DiT -> gpu:1") and "MultiGPU CFG Split (ComfyUI) runs copies on " \
        "cuda:0" in note
    monkeypatch.setattr(TwinPatcher, "get_additional_models_with_key", lambda self, key: [])
    _, plain = comfy_placement.place_model(TwinPatcher(tiny_twin), 1)
    assert "CFG Split" not in plain


def test_a_loader_device_choice_the_placement_overrides_is_said(tiny_twin, monkeypatch):
    """CLIPLoader's device "cpu" (or newer core's loader device inputs) left the patcher off
    ComfyUI's default device: the pack's placement note says it overrides that choice."""
    from h3_multigpu.comfy_seam import models

    monkeypatch.setattr(models, "default_device", lambda: torch.device("cuda", 0))
    model = TwinPatcher(tiny_twin)
    model.load_device = torch.device("cpu")  # the loader's choice
    _, note = comfy_placement.place_model(model, 1)
    assert "the loader's device input (or a ComfyUI flag) chose cpu" in note
    model.load_device = torch.device("cuda", 0)  # ComfyUI's default: nobody chose
    _, plain = comfy_placement.place_model(model, 1)
    assert "chose" not in plain



def test_the_plan_node_weighs_cfg_split_above_cfg_1():
    """The Plan node's pass1_cfg/pass2_cfg reach the planner: at CFG 4 on two H200s both passes
    run ComfyUI's MultiGPU CFG Split, at the default 1 neither considers it."""
    from h3_multigpu.nodes.planning import make_plan

    sizes = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                 seconds=5.0, devices="2xH200", lora_rank=128)
    split = make_plan(**sizes, pass1_cfg=4.0, pass2_cfg=4.0)
    assert {p.mode for p in split.parallel.passes.values()} == {"cfg"}
    assert "MultiGPU CFG Split (max_gpus 2)" in split.report()
    plain = make_plan(**sizes)
    assert all("cfg" not in p.options_s for p in plain.parallel.passes.values())


def test_a_cfg_split_plan_without_core_cfg_split_says_so(tiny_twin):
    """Outside a ComfyUI with comfy.multigpu the plan's CFG split cannot be set up: the line
    says so and the model is unchanged (both calls on the root)."""
    from h3_multigpu.nodes.features import apply_plan
    from h3_multigpu.nodes.placement import Placement
    from h3_multigpu.nodes.planning import make_plan

    plan = make_plan(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                     seconds=5.0, devices="2xH200", lora_rank=128, pass1_cfg=4.0,
                     pass2_cfg=4.0)
    model = TwinPatcher(tiny_twin)
    out, lines = apply_plan(model, plan, Placement(root=1, helper=0, gpus=()))
    assert lines["cfg_split"].startswith("NOT ACTIVE: this ComfyUI has no MultiGPU CFG Split")
    assert "PASS1, PASS2 run cond and uncond one after the other" in lines["cfg_split"]
    _, one = apply_plan(model, plan, Placement(root=1, helper=None, gpus=()))
    assert one["cfg_split"].startswith("off: only one GPU is in use here")
    _, plain = apply_plan(model, make_plan(pass2_width=1312, pass2_height=736, pass1_width=864,
                                           pass1_height=480, seconds=5.0, devices="1x5090",
                                           lora_rank=128), Placement(root=0, helper=None, gpus=()))
    assert "cfg_split" not in plain
