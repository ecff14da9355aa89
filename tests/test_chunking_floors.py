"""Row floors per GEMM shape (chunking/exact_rows.json) and how chunking and the planner use them.

The shipped table is the H200 sweep (dev/bench/sweep_chunk_exactness.py): base GEMMs exact from
256-512 rows, the on-activation LoRA's down projections only from 2,300-8,192 rows, fc2's
rank-32 one never. On the CPU the block tests install a fake table for the tiny twin's shapes
(`exact_rows.table_for` is the seam), with the generic floor EXACT_MIN_ROWS scaled down to it.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from twin import TwinPatcher, make_inputs, make_twin
from twin.adapters import attach_activation_lora

from h3_multigpu.chunking import (
    ChunkingConfig,
    apply_activation_chunking,
    get_chunking,
    sizing,
)
from h3_multigpu.chunking.sizing import Adapters, BlockDims, Kernels, RowFloors
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common import exact_rows
from h3_multigpu.common import floors as common_floors

H200 = "NVIDIA H200"
H3 = exact_rows.linear_shapes(5376, 56 * 128, 14336)
ALL = ("qkv_proj", "out_proj", "fc1", "fc2")


def _floors(ranks: dict[str, tuple[int, ...]], device: str = H200, gpu: bool = True):
    table = exact_rows.table_for(device, "bfloat16")
    return {phase: exact_rows.phase_floor(table, H3, ranks, names, where=device, gpu=gpu)
            for phase, names in exact_rows.PHASE_LINEARS.items()}


def test_the_shipped_table_holds_the_h200_sweep():
    table = exact_rows.table_for(H200, "bfloat16")
    assert table is not None and "NVIDIA H200" in table.source
    assert table.lookup(5376, 128) == (True, 2300) and table.lookup(14336, 32) == (True, None)
    assert table.lookup(14336, 5376) == (True, 512) and table.lookup(5376, 64) == (False, None)
    assert exact_rows.table_for(H200, "float16") is None
    assert exact_rows.table_for("NVIDIA GeForce RTX 5060 Ti", "bfloat16") is None


def test_phase_floors_follow_the_adapters_and_their_ranks():
    assert _floors({}) == {"qkv": (256, ""), "ffn": (512, "")}
    rank128 = _floors({name: (128,) for name in ALL})
    assert rank128 == {"qkv": (3328, ""), "ffn": (8192, "")}  # out_proj's and fc2's down
    rank32_fc2 = _floors({"qkv_proj": (32,), "fc2": (32,)})
    assert rank32_fc2["qkv"] == (5000, "")
    assert rank32_fc2["ffn"] == (None, "on-activation LoRA on fc2, rank 32")
    unmeasured = _floors({"fc1": (64,)})["ffn"]
    assert unmeasured[0] is None and "fc1, rank 64: no row floor measured" in unmeasured[1]
    other_gpu = _floors({"qkv_proj": (128,)}, device="NVIDIA GeForce RTX 5060 Ti")
    assert other_gpu["qkv"][0] is None and other_gpu["ffn"] == (0, "")  # base GEMMs: generic
    on_cpu = _floors({"qkv_proj": (128,)}, device="cpu", gpu=False)
    assert on_cpu == {"qkv": (0, ""), "ffn": (0, "")}  # the CPU stand-in keeps the generic rule


def test_row_chunks_never_go_below_a_raised_floor():
    ranges = sizing.row_chunks(16_400, 4096, 8192)
    assert len(ranges) == 2 and min(b - a for a, b in ranges) >= 8192
    assert sizing.row_chunks(16_000, 4096, 8192) == [(0, 16_000)]  # two would go under 8,192
    assert [b - a for a, b in sizing.row_chunks(3320, 777, 8192)] == [664] * 5  # honoured
    assert sizing.row_chunks(20_000, 4096) == sizing.row_chunks(20_000, 4096, None)


def test_notes_name_the_adapter_without_a_floor():
    floors = RowFloors(ffn=None, ffn_why="on-activation LoRA on fc2, rank 32")
    assert sizing.exactness_note(4096, 4096, 14, floors) == (
        "may differ from unchunked at bf16 rounding (on-activation LoRA on fc2, rank 32)")
    assert sizing.exactness_note(0, 4096, 14, floors) == "exact"
    line = ChunkingConfig(ffn_chunk=4096).status(50, note=sizing.exactness_note(4096, 0, 0,
                                                                                floors))
    assert line.endswith("(on-activation LoRA on fc2, rank 32)")


def test_auto_and_the_planner_realise_chunks_above_the_floors():
    dims = BlockDims()
    adapters = Adapters(rank=128, qkv=1, out_proj=1, fc1=1, fc2=1)
    floors = RowFloors(qkv=3328, ffn=8192)
    choice = sizing.choose_chunks(2 << 30, 68_962, dims, adapters=adapters, floors=floors)
    assert choice.ffn_chunk and choice.qkv_chunk
    for chunk, floor in ((choice.ffn_chunk, 8192), (choice.qkv_chunk, 4096)):
        assert min(b - a for a, b in sizing.row_chunks(68_962, chunk, floor)) >= floor
    # the planner predicts with the table: a rank-32 LoRA on qkv/fc1 needs 5,000-row chunks
    assert sizing.planned_floors(dims, Adapters(rank=32, qkv=1, fc1=1)) == RowFloors(5000, 5000)


def test_the_users_15s_case_still_fits_with_rank_32_and_128():
    from h3_multigpu.planner import PlanRequest, plan_job

    for rank in (128, 32):
        plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700",
                                    lora_rank=rank, parallel="heads"))
        assert plan.fits and plan.chunking.qkv_chunk, rank
        floors = sizing.planned_floors(BlockDims(), Adapters(rank=rank, qkv=1, fc1=1))
        realised = sizing.row_chunks(plan.tokens, plan.chunking.qkv_chunk,
                                     floors.split_floor("qkv"))
        assert min(b - a for a, b in realised) >= floors.split_floor("qkv") and len(realised) > 1
        assert plan.chunking.reason.endswith("(row chunking: exact)"), plan.chunking.reason
    unmeasured = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700",
                                      lora_rank=64, parallel="heads"))
    assert "rank 64: no row floor measured" in unmeasured.chunking.reason


# ------------------------------------------------------------------ the block, on the CPU
BF16 = torch.bfloat16
RANK = 4
# the tiny twin (hidden 64, inner 128, ffn 96) with rank-4 adapters: fake measured floors
FAKE = {"64->384": 0, "128->64": 0, "64->192": 0, "96->64": 0,
        "64->4": 12, "4->384": 8, "128->4": 12, "4->64": 8, "4->192": 8, "96->4": 20}


@pytest.fixture
def fake_floors(monkeypatch):
    """A measured table for this CPU, floors scaled to the 44-row tiny twin."""
    floors = dict(FAKE)
    table = exact_rows.GemmTable("cpu", "bfloat16", floors, "fake (test)")
    monkeypatch.setattr(exact_rows, "table_for",
                        lambda device, dtype: table if (device, dtype) == ("cpu",
                                                                           "bfloat16") else None)
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 8)
    return floors


@pytest.fixture
def lora_twin(tiny_config):
    model = make_twin(tiny_config, dtype=BF16, seed=3)
    for i, block in enumerate(model.blocks):
        for j, linear in enumerate((block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1,
                                    block.mlp.fc2)):
            attach_activation_lora(linear, RANK, seed=10 * i + j)
    inputs = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=5,
                         dtype=BF16)  # S = 44
    return model, inputs


def _rows_seen(model) -> dict[str, list[int]]:
    """Rows per call: fc1/fc2 by pre-hook (module calls inside each MLP chunk); qkv_proj by an
    instance forward under the chunk wrapper (which calls the forward it finds per chunk),
    looked through like an adapter's (`original_forward`)."""
    rows: dict[str, list[int]] = {}
    block = model.blocks[1]
    qkv = block.attn.qkv_proj
    inner = qkv.forward

    def forward(x):
        rows.setdefault("qkv", []).append(x.shape[0])
        return inner(x)

    forward.original_forward = inner
    qkv.forward = forward
    for name, module in (("fc1", block.mlp.fc1), ("fc2", block.mlp.fc2)):
        module.register_forward_pre_hook(
            lambda _m, args, name=name: rows.setdefault(name, []).append(args[0].shape[0]))
    return rows


def _line(patcher) -> str:
    return protocol.status_lines(patcher)["chunking"]


def test_chunks_stay_above_every_adapter_floor_and_are_exact(fake_floors, lora_twin):
    model, inputs = lora_twin
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8,
                                                                           qkv_chunk=8))
    assert _line(patched).endswith("; exact")
    rows = _rows_seen(model)
    out = patched.apply_model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    # fc2's down projection needs 20 rows, qkv/out_proj's 12: two FFN chunks, three QKV chunks
    assert rows["fc1"] == rows["fc2"] == [22, 22] and rows["qkv"] == [15, 15, 14]
    plan = get_chunking(patched).chunkers[1].last_plan
    assert (plan.ffn_floor, plan.qkv_floor, plan.inexact) == (20, 12, ())
    assert _line(patched).endswith("; exact")


def test_a_phase_without_a_floor_stays_whole_while_it_fits(fake_floors, lora_twin, monkeypatch):
    fake_floors["96->4"] = None  # fc2's adapter: no size is exact
    model, inputs = lora_twin
    reference = TwinPatcher(model).apply_model(*inputs)
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 1 << 40)
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8,
                                                                           qkv_chunk=8))
    # at apply time the twin's adapters are already on the modules: the line says so
    assert "(on-activation LoRA on fc2, rank 4)" in _line(patched), _line(patched)
    rows = _rows_seen(model)
    out = patched.apply_model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    assert rows["fc1"] == [44] and len(rows["qkv"]) == 3  # FFN whole, QKV still chunked
    line = _line(patched)
    assert "ffn left whole (on-activation LoRA on fc2, rank 4; it fits unchunked)" in line
    assert line.endswith("; exact"), line


def _as_fp32(tree):
    if isinstance(tree, torch.Tensor):
        return tree.float() if tree.is_floating_point() else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_fp32(t) for t in tree)
    return tree


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_memory_pressure_chunks_it_and_says_it_may_differ(fake_floors, lora_twin, monkeypatch,
                                                          caplog):
    fake_floors["96->4"] = None
    model, inputs = lora_twin
    reference = TwinPatcher(model).apply_model(*inputs)
    # fp32 reference: the same (bf16) weights and adapters, computed in fp32
    fp32 = TwinPatcher(copy.deepcopy(model).float()).apply_model(*_as_fp32(inputs))
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 0)
    monkeypatch.setattr("h3_multigpu.chunking.report._said", set())
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8,
                                                                           qkv_chunk=8))
    rows = _rows_seen(model)
    caplog.set_level(logging.WARNING, logger="h3_multigpu.chunking.report")
    for _ in range(2):
        out = patched.apply_model(*inputs)
    # no floor for the FFN: split no finer than the generic floor, as asked otherwise
    expected = [b - a for a, b in sizing.row_chunks(44, 8, 8)]
    assert len(expected) > 1 and rows["fc1"] == rows["fc2"] == expected * 2
    line = _line(patched)
    assert line.endswith("may differ from unchunked at bf16 rounding "
                         "(on-activation LoRA on fc2, rank 4)"), line
    said = [r for r in caplog.records if "on-activation LoRA on fc2, rank 4" in r.getMessage()]
    assert len(said) == 1  # once, though two forwards of three blocks ran it
    # not claimed exact: bounded by k = 2 times bf16's own error of the unchunked model
    for chunked, plain, exact in zip(out, reference, fp32, strict=True):
        assert _rel(chunked, plain) <= 2 * _rel(plain, exact)


def test_an_adapter_injected_after_apply_is_found_at_run_time(fake_floors, tiny_config,
                                                              monkeypatch, caplog):
    """ComfyUI injects bypass adapters only while loading: the forwards look each time, and
    the line and the log say what the apply-time line could not know."""
    fake_floors["96->4"] = None
    model = make_twin(tiny_config, dtype=BF16, seed=3)
    inputs = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=5,
                         dtype=BF16)
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 0)
    monkeypatch.setattr("h3_multigpu.chunking.report._said", set())
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8))
    assert _line(patched).endswith("; exact")
    # a clone made before the run (as ComfyUI and the next node make them) reads the live line
    later = patched.clone()
    hooks = [attach_activation_lora(block.mlp.fc2, RANK, seed=i)
             for i, block in enumerate(model.blocks)]
    caplog.set_level(logging.WARNING, logger="h3_multigpu.chunking.report")
    patched.apply_model(*inputs)
    patched.apply_model(*inputs)
    assert _line(patched).endswith("(on-activation LoRA on fc2, rank 4)"), _line(patched)
    assert _line(later) == _line(patched)
    said = [r for r in caplog.records if "on-activation LoRA on fc2, rank 4" in r.getMessage()]
    assert len(said) == 1
    for hook in hooks:
        hook.eject()


@pytest.mark.parametrize("listed", [False, True], ids=["unmeasured GPU", "measured GPU"])
def test_a_gpu_without_measured_floors_is_exact_only_as_assumed(tiny_config, monkeypatch,
                                                                listed):
    """On a GPU model the table does not list, the base GEMMs' floors are the 4,096-row rule
    carried over from the measured GPUs: the status says "exact as assumed" and names it."""
    gpu = "AMD Radeon AI PRO R9700"
    table = exact_rows.GemmTable(gpu, "bfloat16", {}, "fake (test)")
    monkeypatch.setattr("h3_multigpu.common.formats.device_name", lambda device: gpu)
    monkeypatch.setattr(exact_rows, "table_for",
                        lambda device, dtype: table if listed and device == gpu else None)
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 8)
    model = make_twin(tiny_config, dtype=BF16, seed=3)
    inputs = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=5,
                         dtype=BF16)
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8,
                                                                           qkv_chunk=8))
    rows = _rows_seen(model)
    out = patched.apply_model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    assert len(rows["fc1"]) > 1  # the rows were split
    line = _line(patched)
    if listed:
        assert line.endswith("; exact"), line
    else:
        assert f"exact as assumed ({gpu} bfloat16 is not in chunking/exact_rows.json" in line
        assert "dev/bench/sweep_chunk_exactness.py" in line


# ------------------------------------------------------------------ per weight format
def test_row_floors_are_per_weight_format():
    """INT8 ConvRot needs no floor (per-row activation quantization, int32 accumulation);
    FP8 / INT8 without ConvRot are not measured; NVFP4 without input_scale never splits."""
    table = exact_rows.table_for(H200, "bfloat16")
    ranks = {name: () for name in ALL}

    def rule(fmt, adapters=ranks):
        return {phase: exact_rows.phase_rule(table, H3, adapters, names, where=H200,
                                             formats=dict.fromkeys(ALL, fmt))
                for phase, names in exact_rows.PHASE_LINEARS.items()}

    plain = rule("bfloat16")
    assert (plain["qkv"].floor, plain["qkv"].base) == (256, None)  # the table and 4,096 rows
    int8 = rule("int8_convrot")
    # any rows, but the fused SwiGLU fc2 from 2 (a 1-row slice differed on an H200)
    assert (int8["qkv"].floor, int8["qkv"].base, int8["qkv"].never) == (0, 1, False)
    assert (int8["ffn"].floor, int8["ffn"].base, int8["ffn"].never) == (0, 2, False)
    # measured on NVIDIA's CUDA kernel only: the CPU's eager kernel keeps the CPU rule (fp32
    # activations: slices of <= 11 rows differ), another GPU (ROCm) knows no floor
    on_cpu = exact_rows.linear_rule(None, "fc1", 5376, 28672, (), where="cpu", gpu=False,
                                    weight_format="int8_convrot")
    assert (on_cpu.floor, on_cpu.base) == (0, None)
    rocm = exact_rows.linear_rule(None, "fc1", 5376, 28672, (), where="AMD", nvidia=False,
                                  weight_format="int8_convrot")
    assert rocm.floor is None and "NVIDIA GPUs only" in rocm.why
    floors = RowFloors.of_rules(int8["qkv"], int8["ffn"])
    assert floors.split_floor("ffn") == 2 and floors.exact_from("qkv") == 1
    assert sizing.row_chunks(3320, 512, floors.split_floor("ffn")) == \
        sizing.row_chunks(3320, 512, 2)
    assert sizing.row_reasons("ffn", 512, floors) == []  # small chunks stay exact
    assert sizing.row_reasons("ffn", 512, RowFloors()) == ["ffn chunks of 512 rows (< 4096)"]
    # an on-activation adapter's own GEMMs are bf16 ones: its table floor and the 4,096 rule
    lora = rule("int8_convrot", {**ranks, "fc1": (128,)})["ffn"]
    assert (lora.floor, lora.base) == (2300, None)
    for fmt, words in (("fp8", "FP8 weights"), ("int8", "without ConvRot"),
                       ("nvfp4", "static input_scale"), ("TensorCoreConvRotW4A4Layout",
                                                        "no row floor measured")):
        found = rule(fmt)["qkv"]
        assert found.floor is None and not found.never and words in found.why, fmt
    never = rule("nvfp4_dynamic")["ffn"]
    assert never.never and "whole tensor" in never.why
    # mixed formats: the strictest wins
    mixed = exact_rows.phase_rule(table, H3, ranks, ("fc1", "fc2"), where=H200,
                                  formats={"fc1": "int8_convrot", "fc2": "bfloat16"})
    assert (mixed.floor, mixed.base) == (512, None)
    int8_plan = sizing.planned_floors(BlockDims(), Adapters(), "int8_convrot")
    assert int8_plan.split_floor("qkv") == 1 and sizing.planned_floors(
        BlockDims(), Adapters()).split_floor("qkv") == 4096


def test_auto_chunks_an_int8_convrot_block_below_4096_rows():
    dims = BlockDims()
    int8 = RowFloors(qkv_base=1, ffn_base=1)
    kernels = Kernels.of(weight_format="int8_convrot")  # an INT8 block's MLP: the fused fc2
    assert kernels.mlp == "comfy_int8"
    # memory free for the attention phase unchunked but not for the MLP (the budget halfway)
    plain = sizing.block_peak_bytes(8_000, dims, kernels=kernels)
    assert plain.attention_bytes < plain.mlp_bytes
    budget = (plain.attention_bytes + plain.mlp_bytes) // 2 - 8_000 * dims.hidden * 2
    free = int((budget + (512 << 20)) / 0.9) + 1  # choose_chunks' default headroom
    bf16 = sizing.choose_chunks(free, 8_000, dims, floors=RowFloors(), kernels=kernels)
    small = sizing.choose_chunks(free, 8_000, dims, floors=int8, kernels=kernels)
    assert not bf16.fits  # two chunks would go under 4,096 rows: realised whole
    assert len(sizing.row_chunks(8_000, bf16.ffn_chunk, 4096)) == 1
    # no 4,096-row floor to stay above: realised in chunks below it
    realised = [b - a for a, b in sizing.row_chunks(8_000, small.ffn_chunk,
                                                    int8.split_floor("ffn"))]
    assert small.fits and len(realised) > 1 and min(realised) < 4096 and sum(realised) == 8_000
    never = RowFloors(ffn=None, ffn_never=True, ffn_why="fc1: NVFP4 ... whole tensor")
    assert sizing.choose_chunks(1 << 30, 8_000, dims, floors=never).ffn_chunk == 0


class QuantizedTensor(torch.Tensor):
    """A stand-in carrying what `weight_format` reads off ComfyUI's QuantizedTensor (the real
    one is checked against ComfyUI's INT8 ConvRot checkpoints in test_chunking_comfyui)."""

    @staticmethod
    def __new__(cls, layout, **params):
        out = torch.Tensor._make_subclass(cls, torch.zeros(4, 4), False)
        out._layout_cls = layout
        out._params = type("Params", (), {"orig_dtype": torch.bfloat16, **params})()
        return out


@pytest.mark.parametrize("layout,params,input_scale,expected", [
    ("TensorWiseINT8Layout", {"convrot": True}, None, "int8_convrot"),
    ("TensorWiseINT8Layout", {"convrot": False}, None, "int8"),
    ("TensorCoreFP8E4M3Layout", {}, torch.ones(()), "fp8"),
    ("TensorCoreNVFP4Layout", {}, torch.ones(()), "nvfp4"),
    ("TensorCoreNVFP4Layout", {}, None, "nvfp4_dynamic"),
    ("AsymW4A8Int8Layout", {}, None, "AsymW4A8Int8Layout"),
])
def test_weight_format_reads_the_layout(layout, params, input_scale, expected):
    from h3_multigpu.comfy_seam.h3 import weight_format

    linear = torch.nn.Linear(4, 4)
    del linear.weight
    linear.weight = QuantizedTensor(layout, **params)
    linear.input_scale = input_scale
    assert weight_format(linear) == expected
    linear.weight_function = [lambda w: w]  # a lowvram LoRA: the cast dequantizes
    assert weight_format(linear) == "bfloat16"
    assert weight_format(torch.nn.Linear(4, 4).to(torch.float16)) == "float16"


def test_a_never_split_weight_format_keeps_its_phase_whole(monkeypatch, tiny_config):
    """fc1 in NVFP4 without input_scale (a per-tensor activation scale): its phase runs whole
    whatever is asked or free, and the status says why; the other phase still chunks."""
    from h3_multigpu.chunking import wrappers
    from h3_multigpu.comfy_seam import h3 as seam_h3
    from h3_multigpu.common import formats

    real = seam_h3.weight_format
    model = make_twin(tiny_config, dtype=BF16, seed=3)
    fc1s = {id(b.mlp.fc1) for b in model.blocks}
    monkeypatch.setattr(seam_h3, "weight_format",
                        lambda m: "nvfp4_dynamic" if id(m) in fc1s else real(m))
    assert formats.seam_h3 is seam_h3  # the formats and the wrappers read it from there
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 8)
    monkeypatch.setattr(wrappers, "free_device_bytes", lambda device: 1)  # nothing fits
    inputs = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=5,
                         dtype=BF16)
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=8,
                                                                           qkv_chunk=8))
    assert "ffn kept whole (fc1: NVFP4 weights without input_scale" in _line(patched)
    rows = _rows_seen(model)
    out = patched.apply_model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    assert rows["fc1"] == [44] and len(rows["qkv"]) > 1
    assert "ffn kept whole" in _line(patched) and _line(patched).endswith("; exact")
