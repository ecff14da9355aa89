"""The planner's prefetch decisions agree with what the streamer does at run time: the token
refiner's blocks stream with the DiT's, the pinned budget covers them and the staging ring,
the LoRA rank moves memory, and a forced residency that does not fit says so. These plan the
legacy loader (`dynamic_vram="off"`), where the pack's streamer runs; `test_planner_loader.py`
plans ComfyUI's DynamicVRAM."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3_multigpu.common import geometry
from h3_multigpu.offload import sizing
from h3_multigpu.planner import PlanRequest, plan_job
from h3_multigpu.planner.hardware import get_profile

GiB = 1 << 30


def _runtime_blocks(plan) -> list[int]:
    """The host-copy sizes the streamer would allocate: every streamed block (the refiner's
    included) as a flat buffer, a few aligned tensors larger than the file's bytes."""
    pf = plan.prefetch
    flat = plan.sizes.dit_block_bytes + 24 * sizing.ALIGNMENT  # 24 tensors, each padded
    return [flat] * (pf.streamed_blocks + pf.streamed_refiner_blocks)


def test_the_plans_pinned_budget_pins_every_block_the_runtime_streams():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2x5060Ti",
                                dynamic_vram="off"))
    pf = plan.prefetch
    assert pf.streamed_blocks > 0 and pf.streamed_refiner_blocks == geometry.REFINER_BLOCKS
    assert pf.source == "pinned" and pf.staged_blocks == 0
    split = sizing.arena_split(_runtime_blocks(plan), pf.pinned_budget_bytes)
    assert split.staged_blocks == 0  # "pinned" means pinned: nothing through staging


def test_past_the_host_budget_the_plan_counts_the_staged_blocks_as_the_runtime_does():
    profile = replace(get_profile("2x5060Ti"), host_ram_bytes=16 * GiB)
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile=profile,
                                dynamic_vram="off"))
    pf = plan.prefetch
    assert pf.source == "pinned+pageable" and pf.staged_blocks > 0
    split = sizing.arena_split(_runtime_blocks(plan), pf.pinned_budget_bytes)
    assert split.staged_blocks == pf.staged_blocks
    assert f"{pf.staged_blocks} go through the ring" in pf.reason


def test_lora_rank_moves_memory():
    peaks, weights = [], []
    for rank in (0, 16, 128, 512):
        # one GPU: under the sequence mode the head exchange's buffers, not the adapters'
        # temporaries, set the peak (sequence/sizing.py)
        plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2xR9700",
                                    lora_rank=rank, chunking="off", resident_blocks=20,
                                    parallel="off"))
        root = next(g for g in plan.gpus if g.index == plan.root_device)
        peaks.append(root.phases["PASS2"].activations)
        weights.append(plan.sizes.lora_bytes)
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    default = plan_job(PlanRequest(profile="2xR9700")).sizes.lora_bytes  # rank 128
    assert weights[0] == 0 and weights[2] == default
    assert weights[3] == 4 * default and abs(8 * weights[1] - default) < 8


@pytest.mark.parametrize("resident", [50, 40])
def test_a_forced_residency_that_does_not_fit_says_so(resident):
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2x5060Ti",
                                resident_blocks=resident, dynamic_vram="off"), suggest=False)
    assert not plan.fits
    assert "fit on the root GPU" not in plan.prefetch.reason
    assert "DOES NOT FIT" in plan.prefetch.reason and "as requested" in plan.prefetch.reason


def test_a_forced_residency_that_fits_is_not_flagged():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=5, profile="2xH200",
                                resident_blocks=50, dynamic_vram="off"))
    assert plan.fits and plan.prefetch.reason == "all 50 blocks resident, as requested"
