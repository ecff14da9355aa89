"""Chunking on two GPUs inside the real ComfyUI: the real MiniMaxH3 class with H3's widths
(hidden 5376, 56 x 128-dim heads, FFN 14336; 2 DiT blocks + 1 refiner block), bf16, loaded on
cuda:1 while cuda:0 is current, sequences of ~3.4k and ~16.4k tokens, through the real
ModelPatcher and sampler path.

The reference is ComfyUI's own unpatched output, computed with cuda:1 current (the unpatched
model cannot run with cuda:0 current: comfy-kitchen's DLPack export needs its device). Chunked
runs go through `apply_activation_chunking` and the DiT device guard (as the nodes compose
them), which makes cuda:1 current.
Exact settings (the planner's 4096-row / 14-head choice, "auto") must be bit-identical: with an
on-activation LoRA of rank 128 on every linear the row chunks stay above the measured floors of
its down projections (chunking/exact_rows.json: fc2's needs 8,192 rows). A rank-32 LoRA on fc2
has no floor: the FFN stays whole while it fits (exact), and when memory needs it chunked the
line says "may differ" and the error is bounded by k = 2 times bf16's own error of the
unchunked model against fp32. Explicit small chunks must say "may differ" and stay within bf16
rounding.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m "comfyui and multi_gpu" \
        tests/test_chunking_comfyui_gpu.py          # ~2.5 min on 2x H200, most of it building
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from comfyui_h3 import (
    AttentionCounter,
    CallCounter,
    TinyH3Config,
    bypass_adapted_modules,
    import_comfyui_or_skip,
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    run_like_sampler,
    unload_all,
    with_bypass_lora,
    with_lora,
)

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking, sizing
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.floors import EXACT_MIN_ROWS
from h3_multigpu.guard.device import guard_diffusion_model

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu, pytest.mark.multi_gpu]

WIDE = TinyH3Config(hidden=5376, heads=56, head_dim=128, ffn=14336, blocks=2, refiner_blocks=1,
                    dtype=torch.bfloat16)
LONG = (16, 64, 64)    # 16 x 32 x 32 video tokens + audio + text: ~16.4k rows
SHORT = (13, 32, 32)   # ~3.4k rows, the length where small chunks differed by 0.016-0.031
PLANNER = ChunkingConfig(ffn_chunk=4096, qkv_chunk=4096, head_group=14)  # 2x5060Ti's plan
BF16_REL_L2 = 4 * 2.0 ** -8  # k = 4 units of bf16's relative rounding, relative L2 per output
GPU1 = torch.device("cuda", 1)


@pytest.fixture(scope="module")
def wide():
    import_comfyui_or_skip()
    patcher = make_tiny_h3(WIDE, seed=0, load_device=GPU1)
    lora_sd = make_lora_state_dict(patcher, rank=128, seed=3)
    return patcher, lora_sd


@pytest.fixture(autouse=True)
def _cuda0_current():
    torch.cuda.set_device(0)
    unload_all()
    yield
    unload_all()
    assert torch.cuda.current_device() == 0  # every guard restored it


def _reference(patcher, inputs, **kwargs):
    with torch.cuda.device(1):  # ComfyUI unpatched, its model's GPU current
        return run_like_sampler(patcher, inputs, **kwargs)


def _chunked(patcher, config, inputs, **kwargs):
    """Run chunked; returns (outputs, patcher, the block's RowPlan, tokens, status line)."""
    # composed as the nodes do: the DiT device guard makes cuda:1 current
    chunked = guard_diffusion_model(apply_activation_chunking(patcher, config))
    with CallCounter(chunked) as counts, AttentionCounter() as attention:
        out = run_like_sampler(chunked, inputs, **kwargs)
    chunker = get_chunking(chunked).chunkers[0]
    plan = chunker.last_plan
    tokens = counts.rows[0]
    fc1 = len(sizing.row_chunks(tokens, plan.ffn_chunk, plan.ffn_floor))
    qkv = len(sizing.row_chunks(tokens, plan.qkv_chunk, plan.qkv_floor))
    groups = len(sizing.head_groups(WIDE.heads, plan.head_group, tokens))
    assert fc1 * qkv * groups > 1, (plan, tokens)  # chunking engaged
    assert counts.per_block("mlp.fc1") == fc1
    assert chunker.calls["attn.qkv_proj"] >= qkv and chunker.calls["mlp"] >= fc1
    assert attention.default - WIDE.refiner_blocks == WIDE.blocks * groups
    line = protocol.status_lines(chunked)["chunking"]
    return out, chunked, plan, tokens, line


def _smallest_chunk(tokens: int, chunk: int, floor: int) -> int:
    return min(b - a for a, b in sizing.row_chunks(tokens, chunk, floor))


def _equal(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), f"max |diff| {(x.float() - y.float()).abs().max().item():.3e}"


@pytest.mark.parametrize("case", ["plain", "keyframe+audio_mask", "lora", "lora_lowvram",
                                  "bypass_lora"])
def test_planner_chunks_are_bit_identical_on_cuda1(wide, case):
    base, lora_sd = wide
    conditioned = case != "plain"
    inputs = make_inputs(WIDE, latent_thw=LONG, keyframe=conditioned, audio_mask=conditioned)
    patcher, kwargs = base, {}
    if case in ("lora", "lora_lowvram"):
        patcher = with_lora(base, lora_sd)
        kwargs = {"lowvram_bytes": 1} if case == "lora_lowvram" else {}
    elif case == "bypass_lora":
        patcher = with_bypass_lora(base, lora_sd)
    reference = _reference(patcher, inputs, **kwargs)
    unload_all()
    out, chunked, plan, tokens, line = _chunked(patcher, PLANNER, inputs, **kwargs)
    assert tokens > 16_000 and line.endswith("; exact"), line
    assert _smallest_chunk(tokens, plan.ffn_chunk, plan.ffn_floor) >= EXACT_MIN_ROWS
    assert _smallest_chunk(tokens, plan.qkv_chunk, plan.qkv_floor) >= EXACT_MIN_ROWS
    if case == "lora_lowvram":
        assert lowvram_patched_modules(chunked) > 0
    if case == "bypass_lora":
        assert bypass_adapted_modules(chunked) == 4 * (WIDE.blocks + WIDE.refiner_blocks)
        # the rank-128 adapter's down projections: out_proj's exact from 3,328 rows, fc2's
        # from 8,192 (the 4,096-row FFN chunks of the plan gave max |diff| 0.028)
        assert plan.ffn_floor == 8192 and plan.qkv_floor == 4096, plan
        assert _smallest_chunk(tokens, plan.ffn_chunk, plan.ffn_floor) >= 8192
    _equal(out, reference)


def test_auto_under_memory_pressure_is_bit_identical(wide, monkeypatch):
    base, lora_sd = wide
    patcher = with_bypass_lora(base, lora_sd)
    inputs = make_inputs(WIDE, latent_thw=LONG, keyframe=True, audio_mask=True)
    reference = _reference(patcher, inputs)
    unload_all()
    # 1 GiB free at every block: "auto" must chunk rows and heads, inside the exactness floors
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 1 << 30)
    out, _, plan, tokens, line = _chunked(patcher, ChunkingConfig.from_strings(), inputs)
    assert plan.ffn_chunk and line.endswith("; exact"), (plan, line)
    assert _smallest_chunk(tokens, plan.ffn_chunk, plan.ffn_floor) >= 8192, plan
    _equal(out, reference)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fc2_lora_without_a_floor_stays_whole_or_is_bounded(wide, monkeypatch):
    """A rank-32 LoRA on fc2: its down projection 14336->32 never kept one kernel across row
    counts on H200 (chunking/exact_rows.json: null), so no FFN chunk is known exact."""
    base, _ = wide
    lora_sd = make_lora_state_dict(base, rank=32, seed=4,
                                   targets=("attn.qkv_proj", "mlp.fc2"))
    patcher = with_bypass_lora(base, lora_sd)
    inputs = make_inputs(WIDE, latent_thw=LONG, keyframe=True, audio_mask=True)
    reference = _reference(patcher, inputs)
    unload_all()
    # the plan's 4096-row chunks, memory to spare: the FFN stays whole, qkv chunks >= 5,000 rows
    out, _, plan, tokens, line = _chunked(patcher, PLANNER, inputs)
    assert plan.ffn_chunk == 0 and plan.qkv_floor == 5000, plan
    assert _smallest_chunk(tokens, plan.qkv_chunk, plan.qkv_floor) >= 5000
    assert "ffn left whole (on-activation LoRA on fc2, rank 32; it fits unchunked)" in line
    assert line.endswith("; exact"), line
    _equal(out, reference)
    unload_all()
    # memory needs the FFN chunked: it is, and the line says what may differ
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 1 << 30)
    out, _, plan, tokens, line = _chunked(patcher, PLANNER, inputs)
    assert plan.ffn_chunk and line.endswith(
        "may differ from unchunked at bf16 rounding (on-activation LoRA on fc2, rank 32)"), line
    unload_all()
    # the bound: k = 2 times bf16's own error of the unchunked model against fp32 (the same
    # bf16-rounded weights and LoRA, computed in fp32)
    fp32 = make_tiny_h3(replace(WIDE, dtype=torch.float32), seed=0, load_device=GPU1)
    fp32.model.diffusion_model.load_state_dict(
        {k: v.float() for k, v in base.model.diffusion_model.state_dict().items()})
    exact = _reference(with_bypass_lora(fp32, lora_sd), inputs)
    del fp32
    unload_all()
    for chunked, plain, ref in zip(out, reference, exact, strict=True):
        assert _rel(chunked, plain) <= 2 * _rel(plain, ref), (_rel(chunked, plain),
                                                              _rel(plain, ref))


@pytest.mark.parametrize("config", [ChunkingConfig(ffn_chunk=333, qkv_chunk=777, head_group=5),
                                    ChunkingConfig(ffn_chunk=64, qkv_chunk=64, head_group=1)],
                         ids=lambda c: f"{c.ffn_chunk}-{c.qkv_chunk}-{c.head_group}")
def test_small_explicit_chunks_say_so_and_stay_within_bf16_rounding(wide, config):
    base, _ = wide
    inputs = make_inputs(WIDE, latent_thw=SHORT, keyframe=True, audio_mask=True)
    reference = _reference(base, inputs)
    unload_all()
    out, _, _, tokens, line = _chunked(base, config, inputs)
    assert 3_300 < tokens < 3_700
    assert "may differ from unchunked at bf16 rounding" in line, line
    for x, y in zip(out, reference, strict=True):
        rel = ((x.float() - y.float()).norm() / y.float().norm()).item()
        assert rel <= BF16_REL_L2, f"relative L2 {rel:.2e}"


def test_lora_cycles_with_chunking_on_cuda1(wide):
    base, lora_sd = wide
    inputs = make_inputs(WIDE, latent_thw=LONG, keyframe=True, audio_mask=True)
    patchers = {"base": base, "lora": with_lora(base, lora_sd),
                "bypass": with_bypass_lora(base, lora_sd)}
    refs = {name: _reference(p, inputs) for name, p in patchers.items()}
    unload_all()
    for name in ("base", "lora", "base", "bypass", "lora", "base"):
        out, *_ = _chunked(patchers[name], PLANNER, inputs)
        _equal(out, refs[name])
