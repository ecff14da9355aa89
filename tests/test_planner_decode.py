"""The planner's video-decode phase: measured memory and time, and the multi-GPU decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3_multigpu.decode import sizing
from h3_multigpu.planner import PlanRequest, get_profile, plan_job
from h3_multigpu.planner.decode import decode_memory, plan_decode
from h3_multigpu.planner.hardware import H200, RTX5060TI, HardwareProfile

GiB = sizing.GiB
MEASURED = {124: (5.51, 5.8604), 243: (5.555, 11.0719), 362: (5.566, 16.7668)}  # GiB, s


@pytest.mark.parametrize("frames", sorted(MEASURED))
def test_one_gpu_decode_matches_the_h200_measurements(frames):
    peak_gib, seconds = MEASURED[frames]
    weights, acts = decode_memory(1312, 736, frames, sizing.MEASURED_WEIGHT_BYTES)["alone"]
    assert (weights + acts) / GiB == pytest.approx(peak_gib, rel=0.01)
    profile = get_profile("2xH200")
    plan = plan_decode(profile, vae_gpu=0, helpers=[], width=1312, height=736, frames=frames,
                       vae_bytes=sizing.MEASURED_WEIGHT_BYTES, usable_bytes={0: 100 * GiB},
                       held_bytes={})
    assert plan.single_seconds == pytest.approx(seconds, rel=0.06)
    assert not plan.multi and plan.reason == "no other GPU"


def test_window_memory_does_not_grow_with_the_clip():
    short = sum(decode_memory(1312, 736, 124, sizing.MEASURED_WEIGHT_BYTES)["alone"])
    long = sum(decode_memory(1312, 736, 362, sizing.MEASURED_WEIGHT_BYTES)["alone"])
    assert 0 < long - short < 0.1 * GiB  # only the latent grows
    assert sizing.tiles_per_window(1312, 736) == 28


def _pair_plan(frames: int, held: int = 0, usable: int = 100 * GiB, mode: str = "auto",
               profile: HardwareProfile | None = None):
    profile = profile or get_profile("2xH200")
    return plan_decode(profile, vae_gpu=0, helpers=[1], width=1312, height=736, frames=frames,
                       vae_bytes=sizing.MEASURED_WEIGHT_BYTES,
                       usable_bytes={0: usable, 1: usable}, held_bytes={1: held}, mode=mode)


def test_two_h200_share_the_windows_and_predict_the_target():
    for frames, windows in ((243, ((0, 7), (7, 14))), (362, ((0, 11), (11, 21)))):
        plan = _pair_plan(frames)
        assert plan.multi and plan.devices == (0, 1) and plan.windows == windows
        assert plan.single_seconds / plan.seconds >= 1.8
        assert "handed over per cut" in plan.reason and not plan.make_room
        # the helper holds a decoder copy (no encoder) and the same window workspace
        helper_w, helper_a = plan.memory[1]
        root_w, root_a = plan.memory[0]
        assert helper_w < root_w and helper_a < root_a


def test_a_full_helper_is_left_out_or_unloaded_saying_why():
    need = sum(decode_memory(1312, 736, 243, sizing.MEASURED_WEIGHT_BYTES)["helper"])
    room = _pair_plan(243, held=int(20 * GiB), usable=int(20 * GiB + need))
    assert room.multi and not room.make_room
    unload = _pair_plan(243, held=int(20 * GiB), usable=int(20 * GiB))
    assert unload.multi and unload.make_room and "unloads 20.0 GiB from gpu:1" in unload.reason
    small = _pair_plan(243, usable=int(need - GiB))
    assert not small.multi and "gpu:1 has" in small.reason and "need" in small.reason
    assert _pair_plan(243, mode="off").describe() == "one GPU (gpu:0): switched off"
    assert not _pair_plan(22).multi  # one window


def test_a_slower_helper_gets_fewer_windows():
    slow = replace(H200, matmul_tflops=H200.matmul_tflops / 2)
    profile = replace(get_profile("2xH200"), gpus=(H200, slow))
    plan = _pair_plan(362, profile=profile)
    counts = [b - a for a, b in plan.windows]
    assert counts == [14, 7]


def test_plan_job_replaces_the_decode_phase_and_reports_the_decision():
    plan = plan_job(PlanRequest(profile="2xH200", seconds=15))
    assert plan.decode.multi and plan.decode.devices == (0, 1)
    gpu0, gpu1 = plan.gpus
    assert "decode" in gpu0.phases and "decode" in gpu1.phases
    # gpu:1 keeps the DiT's resident weights beside its decoder copy
    assert gpu1.phases["decode"].weights > gpu1.phases["PASS2"].weights
    assert "video decode: 2 GPUs" in plan.report()
    assert plan.to_dict()["decode"]["devices"] == [0, 1]
    off = plan_job(PlanRequest(profile="2xH200", seconds=15, decode="off"))
    assert not off.decode.multi and "decode" not in off.gpus[1].phases
    with pytest.raises(ValueError, match="decode="):
        PlanRequest(decode="maybe")


def test_consumer_pair_plans_a_decode_that_fits():
    plan = plan_job(PlanRequest(profile="2x5060Ti", seconds=10))
    assert plan.fits
    assert plan.decode.multi or "gpu:1" in plan.decode.reason
    one = plan_job(PlanRequest(profile="1x5090", seconds=5))
    assert not one.decode.multi and one.decode.reason == "no other GPU"


def test_handing_over_a_piece_is_far_cheaper_than_a_window():
    link = get_profile("2x5060Ti").link.helper_gbs
    assert sizing.handover_seconds(1312, 736, link) * 100 < sizing.seconds_per_window(
        1312, 736, RTX5060TI.matmul_tflops)
