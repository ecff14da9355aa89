"""ComfyUI's MultiGPU CFG Split as a planner mode (`planner.cfg_split`): weighed above CFG 1
only, timed with the rates of the other modes, its clone counted on the helper, the whole-model
rule of its clones, and CFG split x sequence parallel (2x2) on four GPUs: picked when faster,
timed from the sequence mode's rates, never at CFG 1 or below four GPUs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from h3_multigpu.cli import _cfg
from h3_multigpu.common import geometry
from h3_multigpu.planner import PlanRequest, cfg_split, get_profile, plan_job, timing, two_by_two
from h3_multigpu.planner.timing import gpu_rates, one_gpu_block_s
from h3_multigpu.sequence.sizing import split_counts

TWO_GPU = ("2xR9700", "2x3060", "2x5060Ti", "2xV100", "2xH200")


def _four(name: str = "2xH200"):
    pair = get_profile(name)
    return dataclasses.replace(pair, name=f"4 of {name}", gpus=pair.gpus * 2)


@pytest.mark.parametrize("profile", TWO_GPU)
def test_at_cfg_1_the_split_is_never_weighed(profile):
    plan = plan_job(PlanRequest(profile=profile, seconds=5))
    for p in plan.parallel.passes.values():
        assert p.mode != "cfg" and "cfg" not in p.options_s
    forced = plan_job(PlanRequest(profile=profile, seconds=5, parallel="cfg"))
    for p in forced.parallel.passes.values():
        assert p.mode == "off" and cfg_split.AT_CFG_1 in p.reason


def test_above_cfg_1_the_other_modes_make_two_calls_a_step():
    one = plan_job(PlanRequest(profile="2xH200", seconds=5, parallel="off"))
    two = plan_job(PlanRequest(profile="2xH200", seconds=5, parallel="off", pass1_cfg=4.0,
                               pass2_cfg=4.0))
    for name in ("pass1", "pass2"):
        assert two.step_time_s[name] == pytest.approx(2 * one.step_time_s[name])
    assert two.job_time.pass2_s == pytest.approx(2 * one.job_time.pass2_s)


def test_the_split_step_is_the_slower_gpu_running_one_call():
    plan = plan_job(PlanRequest(profile="2xH200", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    profile = get_profile("2xH200")
    rates = [gpu_rates(g, dit_dtype="int8", attention=plan.attention.kernel)
             for g in profile.gpus]
    for name, tokens in (("pass1", plan.pass1.tokens), ("pass2", plan.pass2.tokens)):
        p = plan.parallel.passes[name]
        tokens += plan.request.text_tokens
        block = max(one_gpu_block_s(tokens, r) for r in rates)
        assert p.mode == "cfg" and p.helper_weights == "replica"  # 141 GB cards: no streaming
        assert plan.step_time_s[name] == pytest.approx(geometry.BLOCKS * block)
        assert p.options_s["cfg"] == pytest.approx(geometry.BLOCKS * block, abs=0.01)
        assert p.options_s["off"] == pytest.approx(2 * p.options_s["cfg"], rel=0.01)
        assert "MultiGPU CFG Split (max_gpus 2)" in p.reason
    # the helper holds CFG Split's whole clone beside the VAEs, the upscaler and one call
    helper = plan.gpus[0].phases["PASS2"]
    sizes = plan.sizes
    whole = sizes.dit_bytes + sizes.lora_bytes
    assert helper.weights == pytest.approx(sizes.vae_bytes + sizes.upscaler_bytes + whole,
                                           rel=0.001)
    assert helper.activations == plan.parallel.passes["pass2"].root_activation_bytes > 0
    assert "CFG split" in plan.report() and plan.to_dict()["cfg"] == {"pass1": 4.0,
                                                                      "pass2": 4.0}


@pytest.mark.parametrize("profile", TWO_GPU)
def test_two_gpus_above_cfg_1_run_the_faster_of_the_split_and_the_pack(profile):
    plan = plan_job(PlanRequest(profile=profile, seconds=5, pass1_cfg=4.0, pass2_cfg=4.0,
                                pass1_steps=20, pass2_steps=4))
    for name, p in plan.parallel.passes.items():
        assert "sequence" in p.options_s
        if "not taken" in p.reason or "serve every pass" in p.reason:
            continue  # the whole-model rule decided (its own test)
        fastest = min(p.options_s, key=p.options_s.get)
        assert p.mode == fastest or "does not fit" in p.reason, (name, p.mode, p.options_s)


def test_a_slow_helper_makes_sequence_parallel_beat_the_split():
    """CFG Split waits for the slower GPU (core splits the two conds evenly); the sequence mode
    weights its rows by speed. An R9700 helper beside a V100 root: sequence parallel; two
    V100s: CFG split."""
    slow, fast = get_profile("2xR9700").gpus[0], get_profile("2xV100").gpus[0]
    pair = dataclasses.replace(get_profile("2xV100"), name="R9700 + V100", gpus=(slow, fast))
    plan = plan_job(PlanRequest(profile=pair, seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    for p in plan.parallel.passes.values():
        assert p.mode == "sequence" and p.options_s["cfg"] > p.options_s["sequence"]
    even = plan_job(PlanRequest(profile="2xV100", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    assert {p.mode for p in even.parallel.passes.values()} == {"cfg"}


def test_the_clones_serve_every_pass_of_the_job():
    """CFG 4 then 1 on two R9700s: a PASS1 split would leave PASS2 without sequence parallel
    beside its clones, and the job is faster without it; said with both job times."""
    plan = plan_job(PlanRequest(profile="2xR9700", seconds=5, pass1_cfg=4.0, pass2_cfg=1.0,
                                pass1_steps=20, pass2_steps=4))
    p1, p2 = plan.parallel.passes["pass1"], plan.parallel.passes["pass2"]
    assert p1.options_s["cfg"] < p1.options_s["sequence"]  # the pass alone would split CFG
    assert p1.mode == "sequence" and p2.mode == "sequence"
    assert "CFG split in PASS1 not taken" in p1.reason and "PASS2 runs on one GPU" in p1.reason
    both = plan_job(PlanRequest(profile="2xR9700", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0,
                                pass1_steps=20, pass2_steps=4))
    assert {p.mode for p in both.parallel.passes.values()} == {"cfg"}


def test_the_legacy_loader_streaming_the_root_refuses_the_split():
    plan = plan_job(PlanRequest(profile="2x5060Ti", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0,
                                dynamic_vram="off"))
    assert plan.prefetch.streamer == "pack" and plan.prefetch.streamed_blocks > 0
    for p in plan.parallel.passes.values():
        assert p.mode != "cfg" and cfg_split.NEEDS_STREAMER in p.reason
    forced = plan_job(PlanRequest(profile="2xH200", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0,
                                  parallel="cfg", chunking="on"))
    assert all(cfg_split.NEEDS_CHUNKING in p.reason for p in forced.parallel.passes.values())


def _pair_block_s(plan, profile, tokens, pair):
    """The sequence mode's block on one pair, with its rates (its row weights where they differ)."""
    rates = [gpu_rates(profile.gpus[i], dit_dtype="int8", attention=plan.attention.kernel)
             for i in pair]
    weights = tuple(r.gemm_tflops for r in rates)
    weights = weights if len(set(weights)) > 1 else (1.0, 1.0)
    heads = tuple(split_counts(geometry.HEADS, weights))
    return timing.sequence_block_s(tokens, rates, heads, profile.link, row_weights=weights,
                                   helper_streamed_block_bytes=0)


def test_four_gpus_above_cfg_1_run_the_2x2_timed_from_the_sequence_rates():
    # an H200 pair and an RTX 5090 pair: the step is the slower pair's (the 5090s')
    h200, rtx = get_profile("2xH200").gpus[0], get_profile("1x5090").gpus[0]
    profile = dataclasses.replace(get_profile("2xH200"), name="2xH200 + 2x5090",
                                  gpus=(rtx, h200, h200, rtx))
    plan = plan_job(PlanRequest(profile=profile, seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    root, helpers = plan.root_device, list(plan.helper_devices)
    pairs = ((root, helpers[1]), (helpers[0], helpers[2]))  # CFG Split's copy: first helper
    assert [profile.gpus[i] for i in pairs[0]] == [h200, h200]
    for name, shape in (("pass1", plan.pass1), ("pass2", plan.pass2)):
        p = plan.parallel.passes[name]
        tokens = shape.tokens + plan.request.text_tokens
        fast, slow = (_pair_block_s(plan, profile, tokens, pair) for pair in pairs)
        assert slow > fast
        assert p.mode == two_by_two.MODE and p.helper_weights == "replica"
        assert plan.step_time_s[name] == pytest.approx(geometry.BLOCKS * slow)  # one call
        assert p.options_s["cfg_sequence"] < p.options_s["cfg"] < p.options_s["off"]
        for a, b in pairs:
            assert f"gpu:{a}+gpu:{b}" in p.reason
        assert two_by_two.HOW in p.reason
    # every GPU holds a whole DiT in the passes: the root its own, the others a copy or clone
    for g in plan.gpus:
        assert g.phases["PASS2"].weights >= plan.parallel.passes["pass2"].helper_weight_bytes
    assert plan.dual_sage.state == "off"  # refused beside CFG Split


def test_the_2x2_is_never_weighed_at_cfg_1_nor_below_four_gpus():
    at_one = plan_job(PlanRequest(profile=_four(), seconds=5))
    two = plan_job(PlanRequest(profile="2xH200", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    for plan in (at_one, two):
        for p in plan.parallel.passes.values():
            assert p.mode != two_by_two.MODE and two_by_two.MODE not in p.options_s
            assert "2x2" not in p.reason  # nothing to say where it cannot apply
    forced = plan_job(PlanRequest(profile="2xH200", seconds=5, pass1_cfg=4.0, pass2_cfg=4.0,
                                  parallel="cfg_sequence"))
    for p in forced.parallel.passes.values():  # the next of its kind: CFG split
        assert p.mode == "cfg" and two_by_two.NEEDS_FOUR in p.reason


def test_short_rows_refuse_the_2x2_by_the_exact_range():
    plan = plan_job(PlanRequest(profile=_four(), seconds=1, width=864, height=480,
                                pass1_cfg=4.0, pass2_cfg=4.0))
    for p in plan.parallel.passes.values():
        assert p.mode == "cfg"
        assert "2x2 not available" in p.reason and "below the exact range" in p.reason


def test_a_2x2_plan_sets_up_three_sequence_helpers_for_the_runtime_groups():
    from h3_multigpu.nodes.features import plan_feature_strings
    from h3_multigpu.sequence.config import config_from_plan

    pair = get_profile("2xH200")
    five = dataclasses.replace(pair, name="5 of 2xH200", gpus=pair.gpus * 2 + pair.gpus[:1])
    plan = plan_job(PlanRequest(profile=five, seconds=5, pass1_cfg=4.0, pass2_cfg=4.0))
    assert {p.mode for p in plan.parallel.passes.values()} == {two_by_two.MODE}
    helpers = list(plan.helper_devices)[:3]  # the fifth GPU sits idle: the groups are even
    wanted = plan_feature_strings(plan)
    assert wanted["sequence"] == {"parallel": "auto",
                                  "helpers": ",".join(f"gpu:{i}" for i in helpers),
                                  "split": "1:1:1:1"}
    assert isinstance(wanted["dual_sage"], str) and wanted["dual_sage"].startswith("off")
    config = config_from_plan(plan, parallel="auto")
    assert config.helpers == tuple(f"cuda:{i}" for i in helpers)
    assert config.split == "1:1:1:1" and len(config.gpu_speeds) == 4
    assert {g.index for g in plan.gpus if "PASS2" in g.phases} == {plan.root_device, *helpers}


@pytest.mark.parametrize("value", [-1.0, 101.0, float("nan"), "4", True])
def test_a_bad_guidance_scale_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"pass2_cfg=.* must be a guidance scale from 0 to 100"):
        PlanRequest(pass2_cfg=value)


def test_the_command_line_reads_one_or_two_scales():
    assert _cfg("4") == (4.0, 4.0) and _cfg("4,1") == (4.0, 1.0)
    with pytest.raises(argparse.ArgumentTypeError, match="cfg 'x' must be one guidance scale"):
        _cfg("x")
