"""Each stage of the planner on its own, on the CPU: request, placement, attention, mode per
pass, memory for that mode, time, verdict; and the hardware data behind them."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

from h3_multigpu.chunking.sizing import Adapters, Kernels
from h3_multigpu.common import geometry
from h3_multigpu.planner import PlanRequest, get_profile, plan_job
from h3_multigpu.planner.attention import resolve_attention
from h3_multigpu.planner.components import OFFICIAL, checkpoint_attention
from h3_multigpu.planner.hardware import (
    DATA_FILE,
    RTX5060TI,
    gpu_from_device,
    spec_for_name,
)
from h3_multigpu.planner.heads import plan_dual_sage
from h3_multigpu.planner.layout import GPUPlan, PhaseMemory, plan_memory
from h3_multigpu.planner.memory import BlockDims, ChunkSettings, block_activation_peak
from h3_multigpu.planner.modes import MIN_SPARE_BYTES, DiTContext, decide_modes
from h3_multigpu.planner.placement import place, reserve_bytes
from h3_multigpu.planner.residency import plan_loader
from h3_multigpu.planner.timing import JobTime, duration, gpu_rates
from h3_multigpu.planner.verdict import check_memory
from h3_multigpu.sequence import sizing as sequence_sizing

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def context(**job) -> DiTContext:
    """Stages 1-2 by hand: what plan_job hands the mode stage."""
    request = PlanRequest(**{"width": 1312, "height": 736, "seconds": 15,
                             "profile": "2xR9700", **job})
    profile = get_profile(request.profile)
    sizes = OFFICIAL
    attention = resolve_attention(requested=request.attention)
    rates = tuple(gpu_rates(g, dit_dtype=request.dit_dtype, attention=attention.kernel)
                  for g in profile.gpus)
    shapes = {"pass1": geometry.PassGeometry(request.pass1_width, request.pass1_height,
                                             request.frame_count),
              "pass2": geometry.PassGeometry(request.width, request.height, request.frame_count)}
    tokens = {n: p.tokens + request.text_tokens for n, p in shapes.items()}
    placement = place(profile=profile, sizes=sizes)
    dual = plan_dual_sage(request=request, profile=profile, placement=placement, rates=rates,
                          tokens=tokens["pass2"])
    return DiTContext(request=request, profile=profile, placement=placement, sizes=sizes,
                      loader=plan_loader(request, profile), attention=attention, rates=rates,
                      dims=BlockDims(element_bytes=2),
                      kernels=Kernels.of(weight_format=request.dit_weight_format), dual=dual,
                      shapes=shapes, tokens=tokens)


# ------------------------------------------------------------------ 1. request
def test_request_attention_and_steps_are_checked_with_the_fix():
    assert PlanRequest(quantized_attention=True).attention == "sage"  # the old flag, an alias
    assert PlanRequest(quantized_attention=True, attention="ck").attention == "ck"
    with pytest.raises(ValueError, match="drop --quantized-attention or use --attention sage"):
        PlanRequest(quantized_attention=True, attention="sdpa")
    with pytest.raises(ValueError, match="attention='xformers' is not valid"):
        PlanRequest(attention="xformers")
    with pytest.raises(ValueError, match="pass2_steps=-1 must be >= 0"):
        PlanRequest(pass2_steps=-1)
    with pytest.raises(ValueError, match="samples nothing.*--steps 8,4"):
        PlanRequest(pass1_steps=0, pass2_steps=0)
    with pytest.raises(ValueError, match="pass1_steps=500 is larger than 200"):
        PlanRequest(pass1_steps=500)


# ------------------------------------------------------------------ 2. placement
def test_placement_puts_the_dit_alone_on_the_root():
    two = place(profile=get_profile("2xR9700"), sizes=OFFICIAL)
    assert two.root == 1 and two.helpers == (0,)
    assert two.components["dit"] == two.components["sampler"] == 1
    assert {two.components[c] for c in ("text_encoder", "video_vae", "latent_upscaler")} == {0}
    usable = 32 * GiB - reserve_bytes(32 * GiB)
    assert two.usable_bytes == {0: usable, 1: usable}
    assert two.helper_free_bytes == usable - OFFICIAL.vae_bytes - OFFICIAL.upscaler_bytes
    one = place(profile=get_profile("1x5090"), sizes=OFFICIAL)
    assert one.root == 0 and one.helpers == () and set(one.components.values()) == {0}
    assert one.helper_free_bytes == 0 and one.role(0) == "root+helper"


# ------------------------------------------------------------------ attention
def _write_dit_with_attention_config(path: Path, config: dict | None) -> None:
    tensors = {"blocks.0.attn.qkv_proj.weight": b"\0" * 16}
    if config is not None:
        tensors["blocks.0.attn.comfy_attention.config"] = json.dumps(config).encode()
    header, blob = {}, b""
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)],
                        "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)


def test_attention_auto_is_comfyuis_default_or_the_checkpoints(tmp_path):
    assert resolve_attention(requested="auto").kernel == "sdpa"
    assert resolve_attention(requested="sage").reason.endswith("(--use-sage-attention)")
    f = tmp_path / "dit.safetensors"
    _write_dit_with_attention_config(f, {"attention": "comfy_kitchen_int8"})
    assert checkpoint_attention(f) == "ck"
    chosen = resolve_attention(requested="auto", checkpoint_kernel=checkpoint_attention(f))
    assert chosen.kernel == "ck" and chosen.quantized and "DiT file" in chosen.reason
    _write_dit_with_attention_config(f, None)
    assert checkpoint_attention(f) is None
    _write_dit_with_attention_config(f, {"attention": "something_new"})
    assert checkpoint_attention(f) is None  # a kernel without rates: ComfyUI's default


def test_the_attention_kernel_sets_the_time():
    times = {k: plan_job(PlanRequest(seconds=10, profile="1x5090", attention=k, lora_rank=0),
                         suggest=False).step_time_s["pass2"] for k in ("sdpa", "sage")}
    assert times["sage"] < 0.55 * times["sdpa"]
    # a kernel this card has no rate for is timed at SDPA's, and the plan says so
    plan = plan_job(PlanRequest(seconds=10, profile="1x5090", attention="ck"), suggest=False)
    assert plan.step_time_s["pass2"] == pytest.approx(
        plan_job(PlanRequest(seconds=10, profile="1x5090"), suggest=False).step_time_s["pass2"])
    assert any("attention ck: gpu:0" in n and "no INT8 attention kernel" in n
               for n in plan.notes)


# ------------------------------------------------------------------ hardware data
def test_gpus_are_matched_by_exact_model_name_and_ti_is_refused():
    assert spec_for_name("NVIDIA GeForce RTX 5060 Ti") is RTX5060TI
    assert spec_for_name("nvidia geforce  rtx 5060 ti").name == RTX5060TI.name  # spacing, case
    for name in ("AMD Instinct MI300X", "NVIDIA TITAN RTX", "NVIDIA GeForce RTX 3060 Ti",
                 "NVIDIA H200 NVL", "Radeon"):
        assert spec_for_name(name) is None, name
        gpu = gpu_from_device(name, 24 * GiB, "cuda")
        assert not gpu.known and gpu.name == name and gpu.memory_bytes == 24 * GiB
    stand_in = gpu_from_device("NVIDIA TITAN RTX", 24 * GiB, "cuda")
    profile = dataclasses.replace(get_profile("2x5060Ti"), gpus=(stand_in, stand_in))
    plan = plan_job(PlanRequest(seconds=5, profile=profile), suggest=False)
    assert sum("'NVIDIA TITAN RTX' is not in the hardware data" in n for n in plan.notes) == 2


def test_every_number_in_the_hardware_data_names_its_source():
    data = json.loads(DATA_FILE.read_text())
    kinds = {"measured", "datasheet", "published", "derived", "estimate"}
    numbers = []

    def walk(node, where):
        if isinstance(node, dict) and "value" in node:
            numbers.append((where, node))
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    walk(data, "profiles.json")
    assert len(numbers) > 50
    for where, item in numbers:
        assert item["kind"] in kinds and len(item["source"]) > 15, where
    # the files the sources cite are in the repository
    cited = {w.strip("(),:;") for _, item in numbers for w in item["source"].split()
             if w.strip("(),:;").endswith(".json")}
    assert cited and all((ROOT / "docs" / "results" / name).is_file() or (ROOT / name).is_file()
                         for name in cited), cited


# ------------------------------------------------------------------ 3. mode per pass
def test_modes_are_chosen_with_the_memory_each_mode_has():
    ctx = context(chunking="off")
    decision = decide_modes(ctx)
    assert {n: p.mode for n, p in decision.parallel.passes.items()} == \
        {"pass1": "sequence", "pass2": "sequence"}
    pass2 = decision.chosen["pass2"]
    # the sequence mode's own memory: half the activations, so every block stays resident
    assert pass2.fits and pass2.prefetch.streamed_blocks == 0
    one_gpu = decision.single["pass2"]
    # each mode's peak is its own model's with the job's kernels (the INT8 block's, as run)
    tokens = ctx.tokens["pass2"]
    adapters = Adapters.turbo_lora(ctx.request.lora_rank)
    seq = sequence_sizing.sequence_memory(tokens, ctx.seq_heads, row_weights=ctx.row_weights,
                                          adapters=adapters, kernels=ctx.kernels)
    alone = block_activation_peak(tokens, ctx.dims, lora_on_activations=True,
                                  lora_rank=ctx.request.lora_rank, kernels=ctx.kernels)
    assert ctx.kernels == Kernels.of(weight_format="int8_convrot")
    assert pass2.memory.root_activation_bytes == seq[0].peak
    assert one_gpu.memory.root_activation_bytes == alone.peak_bytes > seq[0].peak
    assert one_gpu.prefetch.streamed_blocks > 0  # one GPU would have to stream
    assert decision.parallel.passes["pass2"].options_s.keys() == {"off", "heads", "sequence"}


def test_a_mode_that_does_not_fit_loses_to_one_that_does():
    ctx = context(chunking="off", resident_blocks=50)
    decision = decide_modes(ctx)
    pass2 = decision.parallel.passes["pass2"]
    assert pass2.mode == "sequence" and decision.chosen["pass2"].fits
    assert not decision.single["pass2"].fits and "off does not fit" in pass2.reason


# ------------------------------------------------------------------ 4. memory for the modes
def test_the_ordering_bug_residency_and_chunking_follow_the_mode_that_runs():
    """2xR9700, 15 s: both passes run sequence parallel. Residency and chunking must be decided
    for that mode, not for one GPU (the old planner streamed 9 blocks needlessly with 5.4 GiB
    left, and its chunking reason quoted a 13.0 GiB one-GPU peak the chosen mode never has)."""
    off = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700",
                               chunking="off"))
    assert {p.mode for p in off.parallel.passes.values()} == {"sequence"}
    assert off.prefetch.streamed_blocks == 0 and off.prefetch.resident_blocks == 50
    auto = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700"))
    root = auto.gpus[auto.root_device].phases["PASS2"]
    assert f"{root.activations / GiB:.1f} GiB" in auto.chunking.reason
    assert "sequence parallel" in auto.chunking.reason and "13.0" not in auto.chunking.reason


def test_the_model_chunking_is_the_most_aggressive_a_pass_needs():
    ctx = context(width=1312, height=736, seconds=15, profile="2x5060Ti")
    decision = decide_modes(ctx)
    layout = plan_memory(ctx, decision)
    needed = [o.memory.chunks.ffn_chunk for o in decision.chosen.values()]
    assert layout.chunking.ffn_chunk == min(c for c in needed if c) == 4096
    root = layout.gpus[ctx.root]
    for name, label in (("pass1", "PASS1"), ("pass2", "PASS2")):
        assert root.phases[label].activations == layout.passes[name].root_activation_bytes
    assert layout.prefetch.streamed_blocks > 0 and root.headroom_bytes >= MIN_SPARE_BYTES


def test_the_helper_dit_is_one_choice_for_both_passes():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700"))
    weights = {p.helper_weights for p in plan.parallel.passes.values() if p.mode == "sequence"}
    assert weights == {"stream"}  # PASS2 has no room for a replica, so PASS1 streams too
    helper = plan.gpus[0]
    assert helper.phases["PASS1"].weights == helper.phases["PASS2"].weights


# ------------------------------------------------------------------ 5. time
def test_the_job_time_adds_every_step_the_upscale_and_the_decode():
    job = JobTime(pass1_steps=8, pass1_step_s=10.0, pass2_steps=4, pass2_step_s=50.0,
                  upscale_s=3.0, decode_s=60.0)
    assert job.total_s == 80 + 200 + 3 + 60
    plan = plan_job(PlanRequest(seconds=10, profile="2xH200"))
    t = plan.job_time
    assert t.pass1_steps == 8 and t.pass2_steps == 4
    assert t.total_s == pytest.approx(8 * plan.step_time_s["pass1"] + 4 * plan.step_time_s[
        "pass2"] + t.upscale_s + plan.decode.seconds)
    one_pass = plan_job(PlanRequest(seconds=10, profile="2xH200", pass1_steps=0,
                                    pass2_steps=20))
    assert one_pass.job_time.upscale_s == 0 and one_pass.job_time.pass1_s == 0
    assert [duration(s) for s in (48, 750, 5520)] == ["48 s", "12.5 min", "1 h 32 min"]


# ------------------------------------------------------------------ 6. verdict
def test_the_verdict_calls_a_phase_without_spare_tight():
    usable = 30 * GiB
    g = GPUPlan(0, "helper", "x", usable + reserve_bytes(usable), 0)
    g.reserve_bytes = g.capacity_bytes - usable
    g.phases = {"PASS2": PhaseMemory(usable - MIN_SPARE_BYTES // 2, 0),
                "PASS1": PhaseMemory(usable - 2 * GiB, 0)}
    verdict = check_memory([g])
    assert verdict.fits and verdict.tight == ["gpu:0 PASS2 has 0.2 GiB to spare"]
    g.phases["decode"] = PhaseMemory(usable + GiB, 0)
    assert not check_memory([g]).fits
    # a real plan: the sequence helper leaves the spare instead of a 0.0 GiB replica
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700"))
    assert plan.fits and not plan.verdict.tight
    assert all(g.headroom_bytes >= MIN_SPARE_BYTES for g in plan.gpus)


def test_a_plan_always_says_what_to_change():
    fits = plan_job(PlanRequest(seconds=10, profile="1x5090", lora_rank=0))
    assert fits.verdict.advice.startswith("to go faster: --attention sage")
    h200 = plan_job(PlanRequest(seconds=10, profile="2xH200"))
    assert h200.verdict.advice.startswith("to go faster: --attention ck")
    big = plan_job(PlanRequest(seconds=15, profile="2x3060", chunking="off",
                               parallel="heads"))
    assert not big.fits and big.verdict.advice.startswith("to fit: ")
    assert big.verdict.advice.removeprefix("to fit: ") == big.suggestions[0]
    unchanged = plan_job(PlanRequest(seconds=10, profile="1x5090", lora_rank=0,
                                     attention="sage"))
    assert unchanged.verdict.advice.startswith("to go faster: a second GPU")


def test_dual_sage_leaves_a_one_gpu_pass_unsharded():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2x3060"))
    modes = {n: p.mode for n, p in plan.parallel.passes.items()}
    assert modes["pass2"] == "off" and plan.dual_sage.enabled
    assert plan.dual_sage.min_tokens > plan.pass2.tokens + 256
    assert "stays unsharded" in plan.dual_sage.reason


def test_chunk_settings_order():
    assert not ChunkSettings().active and ChunkSettings(ffn_chunk=4096).active
