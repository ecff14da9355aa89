"""The planner's per-pass choice among sequence parallel, Dual-Sage and one GPU, and its model."""

from __future__ import annotations

import pytest

from h3_multigpu.chunking import sizing as block_sizing
from h3_multigpu.planner import PlanRequest, plan_job
from h3_multigpu.sequence import sizing


def test_h200_pair_runs_both_passes_sequence_parallel_near_2x():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2xH200"))
    passes = plan.parallel.passes
    assert passes["pass2"].mode == "sequence" and passes["pass1"].mode == "sequence"
    assert passes["pass2"].speedup >= 1.9 and passes["pass1"].speedup >= 1.8
    assert plan.step_time_s["pass2"] == pytest.approx(passes["pass2"].step_time_s)
    assert plan.parallel.head_split == (28, 28) and plan.parallel.transport == "peer"
    assert passes["pass2"].helper_weights == "replica"  # 141 GB cards hold the whole DiT
    report = plan.report()
    line = next(x for x in report.splitlines() if x.startswith("  PASS2 ("))
    assert "sequence parallel" in line and "helper DiT: replica" in report
    data = plan.to_dict()["parallel"]
    assert data["passes"]["pass2"]["mode"] == "sequence"


def test_fifteen_seconds_fit_two_32gb_cards_without_chunking():
    request = dict(width=1312, height=736, seconds=15, profile="2xR9700", chunking="off",
                   resident_blocks=50)
    one_gpu = plan_job(PlanRequest(**request, parallel="heads"))
    split = plan_job(PlanRequest(**request))
    assert not one_gpu.fits and split.fits
    pass2 = split.parallel.passes["pass2"]
    assert pass2.mode == "sequence" and split.parallel.transport == "host"
    root_single = one_gpu.gpus[one_gpu.root_device].phases["PASS2"].activations
    # the sequence model's shares with the job's kernels (the INT8 block's, as the run reads)
    assert split.kernels == one_gpu.kernels == block_sizing.Kernels.of(weight_format="int8_convrot")
    root, helper = sizing.sequence_memory(
        split.tokens + split.request.text_tokens, (28, 28),
        adapters=block_sizing.Adapters.turbo_lora(split.request.lora_rank), kernels=split.kernels)
    assert (pass2.root_activation_bytes, pass2.helper_activation_bytes) == (root.peak, helper.peak)
    assert helper.peak < root.peak < 0.65 * root_single
    assert split.gpus[0].phases["PASS2"].activations == pass2.helper_activation_bytes


def test_forced_modes_and_one_gpu():
    heads = plan_job(PlanRequest(seconds=10, profile="2xH200", parallel="heads"))
    assert {p.mode for p in heads.parallel.passes.values()} == {"heads"}
    off = plan_job(PlanRequest(seconds=10, profile="2xH200", parallel="off"))
    assert {p.mode for p in off.parallel.passes.values()} == {"off"}
    assert off.step_time_s == off.single_gpu_step_time_s
    single = plan_job(PlanRequest(seconds=10, profile="1x5090"))
    assert {p.reason for p in single.parallel.passes.values()} == {"one GPU"}
    with pytest.raises(ValueError, match="parallel='diagonal'"):
        PlanRequest(parallel="diagonal")


def test_short_passes_stay_outside_the_exact_range():
    # 256x256, 5 s: PASS1 128x128 is ~1,000 tokens; a 2-way split gives < 4096 rows per GPU
    plan = plan_job(PlanRequest(width=256, height=256, pass1_width=128, pass1_height=128,
                                seconds=5, profile="2xH200", parallel="sequence"))
    pass1 = plan.parallel.passes["pass1"]
    assert pass1.mode != "sequence" and "exact range" in pass1.reason


def test_sequence_model_halves_activations_and_beats_dual_sage():
    dims = block_sizing.BlockDims()
    # the twin's block (its SwiGLU keeps no fc1 beside fc2: the MLP halves with the rows)
    twin = block_sizing.Kernels(mlp="twin", attention_output_copy=False)
    for s in (35305, 68706, 102107):
        single = block_sizing.block_peak_bytes(s, dims, kernels=twin).peak_bytes
        root, helper = sizing.sequence_memory(s, (28, 28), kernels=twin)
        assert helper.peak < 0.6 * single and root.peak < 0.7 * single
        # upstream's block (the default): less than one GPU on each, the helper least
        single = block_sizing.block_peak_bytes(s, dims).peak_bytes
        root, helper = sizing.sequence_memory(s, (28, 28))
        assert helper.peak < root.peak < single
        gpus = [sizing.GPUSpeed()] * 2
        one = sizing.one_gpu_block_ms(s, gpus[0])
        seq = sizing.sequence_block_ms(s, gpus, (28, 28), sizing.LinkSpeed())
        relay = sizing.sequence_block_ms(s, gpus, (28, 28),
                                         sizing.LinkSpeed(gbps=50.0, host_relay=True))
        heads = sizing.heads_block_ms(s, gpus, (28, 28), sizing.LinkSpeed())
        assert one / seq > 1.9 and one / seq > one / heads and one / relay > 1.6
    # weighted rows follow throughput: the faster GPU gets more rows and heads
    assert sizing.split_counts(56, [1.0, 0.6]) == [35, 21]


def test_report_calls_dual_sage_standby_when_every_pass_runs_sequence():
    sequence = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2xH200"))
    assert {p.mode for p in sequence.parallel.passes.values()} == {"sequence"}
    report = sequence.report()
    assert "Dual-Sage: standby, heads 28+28" in report and "Dual-Sage: on" not in report
    heads = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2xH200",
                                 parallel="heads")).report()
    assert "Dual-Sage: on, heads 28+28" in heads and "standby" not in heads
