import json
import struct

import pytest

from h3_multigpu.chunking.sizing import Kernels
from h3_multigpu.cli import main
from h3_multigpu.common import geometry
from h3_multigpu.planner import (
    PROFILES,
    BlockDims,
    ChunkSettings,
    PlanRequest,
    block_activation_peak,
    choose_chunks,
    get_profile,
    plan_job,
    read_safetensors_tensor_bytes,
)
from h3_multigpu.planner.components import OFFICIAL, dit_sizes_from_file

GiB = 2**30


def test_profiles_exist():
    for name in ("2xR9700", "2x3060", "2x5060Ti", "2xV100", "2xH200", "1x5090"):
        assert get_profile(name).name == name
    assert get_profile("2xr9700").name == "2xR9700"
    with pytest.raises(ValueError, match="unknown hardware profile 'nope'.*2xR9700"):
        get_profile("nope")


def test_user_case_15s_on_2xR9700_fits():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700"))
    assert plan.fits
    assert plan.tokens == 102_107
    assert plan.root_device == 1 and plan.helper_devices == [0]
    assert plan.placement["text_encoder"] == 0 and plan.placement["dit"] == 1
    # both passes run sequence parallel, which halves the activations: no chunking needed
    assert {p.mode for p in plan.parallel.passes.values()} == {"sequence"}
    assert plan.chunking.ffn_chunk == 0
    assert plan.chunking.reason.startswith("not needed: the PASS2 (sequence parallel) root peak")
    root = plan.gpus[1]
    assert root.peak_bytes <= root.capacity_bytes - root.reserve_bytes
    assert plan.dual_sage.state == "standby" and plan.dual_sage.split == (28, 28)
    assert plan.dual_sage.transport == "host"  # R9700 pair has no peer access
    # on one GPU per block (heads mode) the same job needs the chunks
    heads = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700",
                                 parallel="heads"))
    assert heads.fits and heads.chunking.ffn_chunk > 0 and heads.chunking.qkv_chunk > 0
    assert heads.dual_sage.state == "on" and heads.dual_sage.enabled


def test_user_case_without_chunking_does_not_fit_and_suggests():
    # the user's crash: 15 s PASS2 with the LoRA on activations, unchunked, one GPU per block
    # (the sequence-parallel mode halves the activations and fits: test_planner_parallel.py)
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=15, profile="2xR9700",
                                chunking="off", resident_blocks=50, parallel="heads"))
    assert not plan.fits
    assert any("PASS2" in p for p in plan.problems)
    assert plan.suggestions and "fits" in " ".join(plan.suggestions)


def test_small_cards_stream_blocks():
    plan = plan_job(PlanRequest(width=1312, height=736, seconds=10, profile="2x5060Ti"))
    assert plan.fits
    assert plan.prefetch.streamed_blocks > 0
    assert plan.prefetch.resident_blocks + plan.prefetch.streamed_blocks == 50


def test_single_gpu_profile_has_no_dual_sage():
    plan = plan_job(PlanRequest(seconds=5, profile="1x5090"))
    assert not plan.dual_sage.enabled
    assert plan.root_device == 0 and plan.helper_devices == []
    assert set(plan.placement.values()) == {0}


def test_dual_sage_helps_more_on_longer_sequences():
    p = plan_job(PlanRequest(seconds=15, profile="2xH200"))
    s = p.single_gpu_step_time_s
    t = p.step_time_s
    assert s["pass2"] / t["pass2"] > s["pass1"] / t["pass1"] > 1.0


def test_activation_model_unchunked_per_token():
    e, c, i, f = 2, geometry.HIDDEN, geometry.INNER, geometry.FFN  # bf16 bytes, widths
    peak = block_activation_peak(1000, BlockDims())
    # upstream's MLP (ComfyUI's linear_input_act): x + h + fc1 (held through fc2) + the SwiGLU
    # product + fc2's output, per token
    assert peak.mlp_bytes == 1000 * e * (2 * c + 2 * f + f + c)
    # x + h + qkv + the attention output and its reshape copy (ComfyUI's attention functions)
    assert peak.attention_bytes == 1000 * e * (2 * c + 3 * i + 2 * i)
    # the official INT8 ConvRot file: the product lives as int8 [S, F] inside the fused fc2
    int8 = block_activation_peak(1000, BlockDims(),
                                 kernels=Kernels.of(weight_format="int8_convrot"))
    assert int8.mlp_bytes == 1000 * (e * (2 * c + 2 * f + c) + f)
    assert int8.attention_bytes == peak.attention_bytes
    lora = block_activation_peak(1000, BlockDims(), lora_on_activations=True, lora_rank=128)
    # the LoRA adds an output-sized [S, 3I] next to the projection (and its [S, r] down output):
    # the attention phase's peak moves to the projection
    assert lora.attention_bytes == 1000 * e * (2 * c + 2 * 3 * i + 128)


def test_chunking_lowers_peak_and_choose_chunks_respects_budget():
    tokens = 102_107
    plain = block_activation_peak(tokens, lora_on_activations=True).peak_bytes
    chunks = choose_chunks(int(8.5 * GiB), tokens, lora_on_activations=True)
    chunked = block_activation_peak(tokens, BlockDims(), chunks,
                                    lora_on_activations=True).peak_bytes
    assert chunks.ffn_chunk and chunked < plain and chunked <= 8.5 * GiB
    assert choose_chunks(plain, tokens, lora_on_activations=True) == ChunkSettings()


@pytest.mark.parametrize("kwargs,match", [
    (dict(width=1296, height=720), "use 1312x736"),
    (dict(frames=125, seconds=None), "17k\\+5"),
    (dict(profile="3xFoo"), "unknown hardware profile"),
    (dict(dual_sage="maybe"), "dual_sage='maybe'"),
    (dict(resident_blocks=51), "resident_blocks=51"),
    (dict(dit_dtype="fp4"), "dit_dtype 'fp4'"),
    (dict(lora_rank=-1), "lora_rank=-1 must be >= 0"),
])
def test_bad_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_job(PlanRequest(**kwargs))


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]):
    header, offset = {}, 0
    sizes = {"BF16": 2, "I8": 1, "F32": 4}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_sizes_from_safetensors_header(tmp_path):
    f = tmp_path / "dit.safetensors"
    _write_safetensors(f, {
        "blocks.0.attn.qkv_proj.weight": ("I8", [30, 10]),
        "blocks.0.attn.qkv_proj.weight_scale": ("F32", [30]),
        "blocks.1.mlp.fc1.weight": ("BF16", [20, 10]),
        "token_refiner.blocks.0.mlp.fc1.weight": ("BF16", [100, 10]),
        "final_layer.video_out.weight": ("F32", [4, 10]),
    })
    sizes = read_safetensors_tensor_bytes(f)
    assert sizes["blocks.0.attn.qkv_proj.weight"] == 300
    dit = dit_sizes_from_file(f, OFFICIAL)
    assert dit.dit_block_bytes == 420 and dit.dit_bytes == 300 + 120 + 400 + 2000 + 160
    with pytest.raises(ValueError, match="does not exist"):
        read_safetensors_tensor_bytes(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors_tensor_bytes(bad)


def test_cli_plan_json(capsys):
    rc = main(["plan", "--profile", "2xR9700", "--width", "1312", "--height", "736",
               "--seconds", "15", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True and out["tokens"] == 102_107
    roles = {g["role"] for g in out["gpus"]}
    assert roles == {"root", "helper"}
    for g in out["gpus"]:
        assert {"index", "role", "capacity_bytes", "peak_bytes"} <= set(g)
        assert g["peak_bytes"] <= g["capacity_bytes"]


def test_cli_plan_text_and_errors(capsys):
    assert main(["plan", "--profile", "2x3060", "--seconds", "5"]) == 0
    text = capsys.readouterr().out
    assert "gpu:1" in text and "decisions:" in text and "FITS" in text
    assert main(["plan", "--profile", "2xR9700", "--width", "1296", "--height", "720"]) == 2
    assert "use 1312x736" in capsys.readouterr().err
    assert main(["profiles"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in PROFILES)


def test_geometry_and_planner_agree_on_tokens():
    plan = plan_job(PlanRequest(width=864, height=480, seconds=10, profile="2xH200",
                                pass1_width=864, pass1_height=480))
    assert plan.tokens == geometry.video_audio_tokens(864, 480, 243)


def test_planner_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, h3_multigpu.planner, h3_multigpu.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_detect_hardware_reads_the_gpus_torch_sees(monkeypatch):
    import types

    import torch

    from h3_multigpu.planner import detect_hardware

    props = [types.SimpleNamespace(name="NVIDIA GeForce RTX 5060 Ti", total_memory=16 * GiB),
             types.SimpleNamespace(name="NVIDIA GeForce RTX 5090", total_memory=32 * GiB)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    profile = detect_hardware()
    assert [g.name for g in profile.gpus] == [p.name for p in props]
    assert [g.memory_bytes for g in profile.gpus] == [16 * GiB, 32 * GiB]
    assert all(g.known for g in profile.gpus)
    assert not profile.link.peer_access
    # unequal cards: the planner weights the head split by each card's attention rate
    plan = plan_job(PlanRequest(seconds=10, profile=profile, parallel="heads"))
    assert plan.dual_sage.enabled and sum(plan.dual_sage.split) == 56
    assert plan.dual_sage.split[0] > plan.dual_sage.split[1]  # the root (5090) is faster
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA/ROCm GPU"):
        detect_hardware()
