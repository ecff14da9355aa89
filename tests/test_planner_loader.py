"""The planner plans for the loader that runs: ComfyUI's DynamicVRAM (NVIDIA, ROCm 7.14+) or
the legacy loader with the pack's streamer (ROCm below 7.14, --disable-dynamic-vram, ...).

Under DynamicVRAM the plan describes ComfyUI's VBAR, its one-block prefetch and its pins, and
sizes the root GPU with one block in flight beside the running one; on the legacy loader it
describes the pack's streamer (K = 2 ahead, K + 1 slots, pinned arena and staging ring).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from h3_multigpu.cli import main
from h3_multigpu.common import geometry
from h3_multigpu.offload import sizing
from h3_multigpu.planner import PlanRequest, get_profile, plan_job, timing
from h3_multigpu.planner.plan import _dit_fixed_bytes
from h3_multigpu.planner.residency import COMFY_LOOKAHEAD, LOOKAHEAD

GiB = 1 << 30
JOB = dict(width=1312, height=736, seconds=10)


def root(plan):
    return next(g for g in plan.gpus if g.index == plan.root_device)


@pytest.mark.parametrize("name,mode", [("2x5060Ti", "dynamic"), ("2x3060", "dynamic"),
                                       ("2xV100", "dynamic"), ("2xH200", "dynamic"),
                                       ("1x5090", "dynamic"), ("2xR9700", "legacy")])
def test_auto_is_comfyuis_rule(name, mode):
    plan = plan_job(PlanRequest(**JOB, profile=name))
    assert plan.loader.mode == mode
    if name == "2xR9700":
        assert "ROCm 7.2 is below 7.14" in plan.loader.reason


def test_rocm_from_7_14_and_old_torch():
    r9700 = get_profile("2xR9700")
    assert plan_job(PlanRequest(**JOB, profile=replace(r9700, rocm_version=(7, 14)))
                    ).loader.mode == "dynamic"
    assert plan_job(PlanRequest(**JOB, profile=replace(r9700, rocm_version=None))
                    ).loader.mode == "legacy"
    old = replace(get_profile("2x5060Ti"), torch_version=(2, 7))
    plan = plan_job(PlanRequest(**JOB, profile=old))
    assert plan.loader.mode == "legacy" and "older than 2.8" in plan.loader.reason


def test_under_dynamic_vram_the_plan_describes_comfyuis_streaming():
    plan = plan_job(PlanRequest(**JOB, profile="2x5060Ti"))
    pf = plan.prefetch
    assert plan.fits and pf.streamed_blocks > 0 and pf.streamer == "comfyui"
    assert pf.lookahead == COMFY_LOOKAHEAD == 1 and pf.staged_blocks == 0
    assert "ComfyUI DynamicVRAM: its VBAR on gpu:1" in pf.reason
    assert "make_prefetch_queue, one ahead" in pf.reason and "ComfyUI pins" in pf.reason
    assert "blocks ahead" not in pf.reason and "staging ring" not in pf.reason  # not ours
    report = plan.report()
    assert "  loader: ComfyUI DynamicVRAM (comfy-aimdo" in report
    assert f"DiT blocks: {pf.resident_blocks} resident, {pf.streamed_blocks} streamed -- " \
           "ComfyUI DynamicVRAM" in report


def test_peaks_and_residency_follow_the_loader():
    dynamic = plan_job(PlanRequest(**JOB, profile="2x5060Ti"))
    legacy = plan_job(PlanRequest(**JOB, profile="2x5060Ti", dynamic_vram="off"))
    block = dynamic.sizes.dit_block_bytes
    fixed = _dit_fixed_bytes(dynamic.sizes) + dynamic.sizes.lora_bytes
    d, g = dynamic.prefetch, legacy.prefetch
    assert g.streamer == "pack" and g.lookahead == LOOKAHEAD and "2 blocks ahead" in g.reason
    # DynamicVRAM holds the running block and the one it stages; the pack K + 1 = 3 slots
    assert root(dynamic).phases["PASS2"].weights == fixed + (d.resident_blocks + 2) * block
    assert root(legacy).phases["PASS2"].weights == fixed + (g.resident_blocks + 3) * block
    assert d.resident_blocks == g.resident_blocks + 1  # one block-sized buffer fewer
    assert root(dynamic).phases["PASS2"].activations == root(legacy).phases["PASS2"].activations


def test_dynamic_copies_hide_behind_one_block_only():
    """With a slow link the copies show: DynamicVRAM's one-ahead prefetch gives each streamed
    block one block of compute to hide behind."""
    profile = get_profile("2x3060")
    profile = replace(profile, link=replace(profile.link, host_pinned_gbs=0.1))
    plan = plan_job(PlanRequest(width=864, height=480, seconds=5, profile=profile,
                                parallel="off", dual_sage="off"))
    pf = plan.prefetch
    assert pf.streamer == "comfyui" and pf.source == "pinned" and pf.streamed_blocks > 0
    rates = timing.gpu_rates(profile.gpus[plan.root_device], dit_dtype="int8",
                             attention="sdpa")
    for name in ("pass1", "pass2"):
        tokens = (plan.pass1 if name == "pass1" else plan.pass2).tokens + 256
        block = timing.one_gpu_block_s(tokens, rates)
        copy = timing.block_copy_s(plan.sizes.dit_block_bytes, profile.link)
        overhead = sizing.one_ahead_overhead_seconds(
            streamed=pf.streamed_blocks, block_compute_s=block, block_copy_s=copy)
        assert overhead > 0
        assert plan.step_time_s[name] == pytest.approx(geometry.BLOCKS * block + overhead)


def test_comfyuis_pin_budget_is_planned_with():
    budget = 20 * GiB
    plan = plan_job(PlanRequest(**JOB, profile="2x5060Ti", pinned_budget_bytes=budget))
    assert plan.loader.pinned_budget_bytes == budget
    assert "ComfyUI's MAX_PINNED_MEMORY" in plan.loader.describe()
    assert "(20 GiB, ComfyUI's MAX_PINNED_MEMORY)" in plan.prefetch.reason
    tight = plan_job(PlanRequest(**JOB, profile="2x5060Ti", pinned_budget_bytes=4 * GiB))
    assert tight.prefetch.source == "pinned+pageable" and "stay pageable" in tight.prefetch.reason
    legacy = plan_job(PlanRequest(**JOB, profile="2x5060Ti", dynamic_vram="off",
                                  pinned_budget_bytes=4 * GiB))
    assert legacy.prefetch.staged_blocks > 0  # the pack's streamer stages past the budget


def test_forced_residency_needs_the_legacy_loader():
    with pytest.raises(ValueError, match="--dynamic-vram off"):
        PlanRequest(resident_blocks=10, dynamic_vram="on")
    with pytest.raises(ValueError, match="DynamicVRAM is on for 2x5060Ti"):
        plan_job(PlanRequest(**JOB, profile="2x5060Ti", resident_blocks=10))
    plan = plan_job(PlanRequest(**JOB, profile="2x5060Ti", resident_blocks=10,
                                dynamic_vram="off"))
    assert plan.prefetch.resident_blocks == 10 and plan.prefetch.streamer == "pack"
    with pytest.raises(ValueError, match="dynamic_vram='maybe'"):
        PlanRequest(dynamic_vram="maybe")


def test_cli_flag_and_json(capsys):
    assert main(["plan", "--profile", "2x5060Ti", "--seconds", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loader"]["mode"] == "dynamic" and out["prefetch"]["streamer"] == "comfyui"
    assert out["prefetch"]["lookahead"] == 1
    assert main(["plan", "--profile", "2x5060Ti", "--seconds", "10", "--json",
                 "--dynamic-vram", "off"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loader"]["mode"] == "legacy" and out["prefetch"]["streamer"] == "pack"
    assert out["prefetch"]["lookahead"] == 2
    assert main(["plan", "--profile", "2x5060Ti", "--resident-blocks", "10", "--json"]) == 2
    refused = json.loads(capsys.readouterr().out)
    assert refused["exit_code"] == 2 and "--dynamic-vram off" in refused["message"]
    assert main(["plan", "--profile", "2xR9700", "--seconds", "15"]) == 0
    text = capsys.readouterr().out
    assert "loader: legacy ModelPatcher" in text and "ROCm 7.2 is below 7.14" in text
