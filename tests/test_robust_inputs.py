"""Careless and hostile inputs to the planner, its CLI, geometry and the nodes' input checks.

Every refusal names the value and the fix and exits 2; nothing hangs or raises a traceback.
"""

from __future__ import annotations

import json
import struct
import time

import pytest

# Imported, never skipped: check_options answers None for a library missing from the
# install, which would let these tests pass without it.
from h3_multigpu import (
    chunking,
    dual_sage,  # noqa: F401
    offload,  # noqa: F401
)
from h3_multigpu.cli import main
from h3_multigpu.common import geometry
from h3_multigpu.nodes import inputs
from h3_multigpu.nodes.features import check_options
from h3_multigpu.planner import PlanRequest, plan_job, read_safetensors_tensor_bytes
from h3_multigpu.planner import plan as plan_module

# (argv after `plan --profile 2x3060`, a fragment the message must contain)
NASTY_PLAN_ARGVS = [
    (["--seconds", "inf"], "finite number of seconds, got inf"),
    (["--seconds", "nan"], "got nan"),
    (["--seconds", "1e300"], "duration 1e+300 s is longer"),
    (["--seconds", "3600"], "duration 3600 s is longer"),
    (["--seconds", "-5"], "must be positive, got -5.0"),
    (["--frames", "1000000000"], "frame count 1000000000 is more than"),
    (["--frames", "-1"], "frame count -1 is too small"),
    (["--width", "99999999", "--height", "736"], "canvas width 99999999"),
    (["--width", "16384", "--height", "16384"], "canvas 16384x16384 is 260.1x"),
    (["--text-tokens", "1000000000000"], "text_tokens=1000000000000 is larger than 32768"),
    (["--lora-rank", "999999999"], "lora_rank=999999999 is larger than 5376"),
    (["--resident-blocks", "-3"], "resident_blocks=-3 must be between 0 and 50"),
    (["--pass1", "1312x736", "--width", "864", "--height", "480"],
     "PASS2 864x480 is smaller than PASS1 1312x736"),
    (["--measure-link"], "--measure-link measures this machine's GPUs"),
    (["--width", "1e3"], "invalid int value: '1e3'"),
    (["--seconds", "5", "--frames", "124"], "not allowed with argument"),
]


@pytest.mark.parametrize("extra,fragment", NASTY_PLAN_ARGVS)
def test_plan_refuses_nasty_argvs_fast_with_exit_2_in_text_and_json(extra, fragment, capsys):
    argv = ["plan", "--profile", "2x3060", *extra]
    start = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert main([*argv, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    assert error["event"] == "error" and error["exit_code"] == 2 and fragment in error["message"]
    # a generous guard against hangs (the old suggestion search took 48 s), not a speed target
    assert time.monotonic() - start < 20


def test_fit_suggestion_search_is_logarithmic_and_finds_the_longest_clip(monkeypatch):
    calls = []
    real = plan_module.plan_job

    def counting(request, *, suggest=True):
        calls.append(request.frame_count)
        return real(request, suggest=suggest)

    monkeypatch.setattr(plan_module, "plan_job", counting)
    request = PlanRequest(profile="2x3060", seconds=149)  # 3589 frames: 204 grid steps to scan
    plan = counting(request)
    assert not plan.fits
    # bisection over ~200 grid steps: log2 -> 8 plans, plus the first, the floor and canvases
    assert len(calls) <= 20, len(calls)
    longest = next(s for s in plan.suggestions if s.startswith("a shorter clip fits"))
    frames = int(longest.split(": ")[1].split()[0])
    # the longest fitting clip: it fits and the next grid step does not
    assert real(PlanRequest(profile="2x3060", frames=frames), suggest=False).fits
    assert not real(PlanRequest(profile="2x3060", frames=frames + 17), suggest=False).fits


def test_canvas_over_the_native_area_and_untrained_lengths_are_noted():
    plan = plan_job(PlanRequest(profile="2xH200", width=1920, height=1088, frames=39))
    notes = "\n".join(plan.notes)
    assert "PASS2 1920x1088 is 2.02x H3's native area" in notes
    assert "39 frames (1.6 s) is outside H3's trained range 124..362" in notes
    assert not any("native area" in n or "trained range" in n
                   for n in plan_job(PlanRequest(profile="2xH200")).notes)


def test_quantized_attention_on_a_card_without_int8_kernel_is_said():
    plan = plan_job(PlanRequest(profile="2xV100", quantized_attention=True))
    assert any("has no INT8 attention kernel" in n and "V100" in n for n in plan.notes)
    plan = plan_job(PlanRequest(profile="2xH200", quantized_attention=True))
    assert not any("INT8" in n for n in plan.notes)


def test_pass1_larger_than_pass2_is_refused_like_the_node_does():
    with pytest.raises(ValueError, match="PASS2 864x480 is smaller than PASS1 1312x736") as info:
        PlanRequest(width=864, height=480, pass1_width=1312, pass1_height=736, profile="2xH200")
    assert inputs.check_two_pass(1312, 736, 864, 480) == str(info.value)


def _safetensors(path, header) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.mark.parametrize("header,fragment", [
    ([1, 2, 3], "its header is a list"),
    ({"blocks.0.w": {"dtype": "BF16"}}, "tensor 'blocks.0.w' has no valid data_offsets"),
    ({"blocks.0.w": {"data_offsets": ["a", 3]}}, "tensor 'blocks.0.w' has no valid"),
    ({"blocks.0.w": "junk"}, "tensor 'blocks.0.w' has no valid data_offsets"),
    (b"\xff\xfe\x00garbage", "its header is not JSON"),
])
def test_corrupt_dit_header_names_the_file(tmp_path, header, fragment):
    path = tmp_path / "dit.safetensors"
    _safetensors(path, header)
    with pytest.raises(ValueError, match=fragment) as info:
        read_safetensors_tensor_bytes(path)
    assert str(path) in str(info.value)


def test_dit_file_that_is_a_directory_is_named_as_one(tmp_path, capsys):
    folder = tmp_path / "models"
    folder.mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        read_safetensors_tensor_bytes(folder)
    assert main(["plan", "--profile", "2xH200", "--dit-file", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"{folder}: is a folder; give the H3 DiT's .safetensors file inside it" in err


def test_numpy_integer_widths_are_accepted():
    np = pytest.importorskip("numpy")
    assert geometry.validate_canvas(np.int64(1312), np.int32(736)) == (1312, 736)
    assert geometry.validate_frames(np.int64(124)) == 124
    request = PlanRequest(width=np.int64(1312), height=np.int64(736), frames=np.int16(124),
                          profile="2xH200")
    assert type(request.width) is int and plan_job(request).pass2.tokens == 35_305


def test_geometry_refuses_negative_and_unbounded_values():
    with pytest.raises(ValueError, match="frame count -100 is too small"):
        geometry.audio_latent_shape(-100)
    with pytest.raises(ValueError, match="between 0 and"):
        geometry.audio_latent_steps(-100)
    for seconds in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number of seconds"):
            geometry.snap_frames(seconds)
    with pytest.raises(ValueError, match=r"149.7 s = 3592 frames"):
        geometry.snap_frames(1e300)
    assert geometry.snap_frames(geometry.MAX_SECONDS) == geometry.MAX_FRAMES
    with pytest.raises(ValueError, match="canvas width 20000 is larger"):
        geometry.validate_canvas(20000, 32)


@pytest.mark.parametrize("seconds", [float("inf"), 1e300, float("nan")])
def test_plan_node_checks_refuse_unbounded_seconds(seconds):
    message = inputs.check_seconds(seconds)
    assert message and ("finite" in message or "longer than" in message)


@pytest.mark.parametrize("budget,fragment", [
    ("1e400", "more than any machine's memory"),
    ("1e20TiB", "more than any machine's memory"),
    ("nan", "is not 'auto' or a size"),
])
def test_prefetch_pinned_budget_overflow_is_refused_clearly(budget, fragment):
    with pytest.raises(ValueError, match=fragment):
        inputs.parse_bytes(budget, "pinned_budget")
    message = check_options("prefetch", resident_blocks="auto", pinned_budget=budget)
    assert message and f"pinned_budget={budget!r}" in message


@pytest.mark.parametrize("split,fragment", [
    ("28;28", "is not a list of numbers"),
    ("28:27", "sums to 55 but the model has 56 heads"),
    ("nan:1", "not a finite number"),
    ("inf:1", "not a finite number"),
    ("56", "has 1 entries for 2 devices"),
])
def test_dual_sage_split_typos_fail_at_validation(split, fragment):
    message = check_options("dual_sage", helpers="auto", split=split)
    assert message and fragment in message
    assert check_options("dual_sage", helpers="auto", split="28:28") is None
    assert check_options("dual_sage", helpers="gpu:0", split="1.0:0.7") is None


def test_chunk_sizes_that_chunk_nothing_are_not_reported_as_on():
    config = chunking.ChunkingConfig(ffn_chunk=10**12, head_group=56)
    status = config.status(50, heads=56)
    assert status.startswith("off:") and "exact" not in status
    assert "longer than any H3 sequence" in status and "56 heads/call is all 56 heads" in status
    assert not config.active_with(56)
    partly = chunking.ChunkingConfig(ffn_chunk=10**12, qkv_chunk=4096).status(50, heads=56)
    assert partly.startswith("on") and "ffn off (" in partly and "qkv 4096 rows" in partly


@pytest.mark.parametrize("extra,fragment", NASTY_PLAN_ARGVS[:9])
def test_without_a_profile_bad_values_are_refused_before_the_gpus_are_probed(
        extra, fragment, capsys, monkeypatch):
    """No --profile means this machine's GPUs; probing them imports torch (seconds). A bad
    value is named first, without probing."""
    import h3_multigpu.planner as planner

    probes = []
    monkeypatch.setattr(planner, "detect_hardware", lambda **kw: probes.append(kw) or
                        planner.PROFILES["2x3060"])
    assert main(["plan", *extra]) == 2
    assert fragment in capsys.readouterr().err and probes == []
    assert main(["plan", "--seconds", "5"]) == 0 and len(probes) == 1  # a good job probes
