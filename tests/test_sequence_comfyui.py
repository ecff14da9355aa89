"""The sequence-parallel mode on ComfyUI's real MiniMax H3 through the real ModelPatcher.

CPU stand-in devices (every "GPU" is the CPU, 2 to 4 of them), two threads, ComfyUI's own sampler
path, attention function, LoRA patching and lowvram loading, fp32 and INT8 ConvRot checkpoints
(the official DiT format) loaded by ComfyUI's loader: the result must equal ComfyUI's unpatched
output bit for bit. With two threads a CPU GEMM slice of up to 11 rows and a 1-head attention
call can differ from the whole call (measured), so every share here keeps >= 16 rows and every
device >= 2 heads; the split refuses fewer (`test_sequence.py`).

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_sequence_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import (
    AttentionCounter,
    CallCounter,
    TinyH3Config,
    bypass_adapted_modules,
    import_comfyui_or_skip,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    preferred_attention_missing,
    run_like_sampler,
    set_preferred_attention,
    unload_all,
    with_bypass_lora,
    with_lora,
)

from h3_multigpu.sequence import (
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence.apply import DYNAMIC_VRAM_OFF

pytestmark = pytest.mark.comfyui

CONFIGS = [TinyH3Config(adaln="curve", heads=4), TinyH3Config(adaln="full", heads=4)]
INT8 = TinyH3Config(adaln="curve", heads=8, weights="int8_convrot", dtype=torch.bfloat16)
WIDE = {2: TinyH3Config(heads=4), 3: TinyH3Config(heads=8), 4: TinyH3Config(heads=8)}
LONGER = (3, 8, 8)  # 16 text + 10 audio + 48 video rows = 74: >= 18 rows on each of 4 devices


@pytest.fixture(autouse=True)
def _two_threads(fresh_comfyui):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _sequence(patcher, devices: int = 2, **kwargs):
    kwargs.setdefault("chunk_heads", 1)  # raised to the CPU's 2-head minimum
    return apply_sequence_parallel(patcher, SequenceParallelConfig(
        parallel="sequence", helpers=("cpu",) * (devices - 1), **kwargs))


def _status(patcher) -> str:
    return patcher.model_options["transformer_options"]["h3_multigpu"]["sequence"]


@pytest.mark.parametrize("config", CONFIGS + [INT8], ids=["curve", "full", "int8_convrot"])
@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "keyframe+audio_mask"])
def test_equals_comfyui_unpatched(config, conditioned):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=conditioned, audio_mask=conditioned)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher)
    with AttentionCounter() as calls:
        out = run_like_sampler(split, inputs)
    assert _same(base, out)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1 and mode.blocks_run == config.blocks
    # ComfyUI's own attention function ran once per head chunk on each device, per block
    (seq_len,) = mode.decisions
    chunks = sum(len(mode.split.chunks_of(j, seq_len)) for j in range(2))
    assert calls.default == config.refiner_blocks + chunks * config.blocks
    assert all(b - a >= 2 for j in range(2) for a, b in mode.split.chunks_of(j, seq_len))
    assert "sequence parallel sequence" in _status(split)


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_two_three_and_four_devices_equal_unpatched(devices):
    config = WIDE[devices]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher, devices)
    with CallCounter(split) as counts:
        out = run_like_sampler(split, inputs)
    assert _same(base, out)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1 and len(mode.devices) == devices
    (seq_len,) = mode.decisions
    shares = [b - a for a, b in mode.split.rows_for(seq_len)]
    # every device ran the block's linears on its own rows: one call each per block
    assert min(shares) >= 16 and counts.calls["mlp.fc1"] == devices * config.blocks
    assert mode.blocks_run == config.blocks and mode.runner is None  # freed after sampling


def test_the_startup_flags_kernel_is_sharded():
    """Every release (0.33.0: always): the kernel ComfyUI's flags made `optimized_attention`
    (basic attention here), run per head share, equal to that kernel unpatched."""
    comfy = import_comfyui_or_skip()
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config)
    basic = comfy.ldm.modules.attention.attention_basic
    default = run_like_sampler(patcher, inputs)
    with AttentionCounter(kernel=basic) as calls:
        base = run_like_sampler(patcher, inputs)
        unpatched = calls.default
        out = run_like_sampler(_sequence(patcher), inputs)
    assert not _same(base, default) and _same(base, out)
    assert unpatched == config.refiner_blocks + config.blocks
    assert calls.default - unpatched == config.refiner_blocks + 2 * config.blocks


def test_preferred_attention_is_sharded_not_replaced():
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    missing = preferred_attention_missing(patcher)
    if missing:
        pytest.skip(missing)
    inputs = make_inputs(config)
    with AttentionCounter() as calls:
        set_preferred_attention(patcher, calls.count_preferred(
            lambda q, k, v, heads, **kw: _sdpa(q, k, v)))
        base = run_like_sampler(patcher, inputs)
        unpatched = calls.preferred
        out = run_like_sampler(_sequence(patcher), inputs)
        set_preferred_attention(patcher, None)
    assert _same(base, out)
    assert unpatched == config.refiner_blocks + config.blocks
    assert calls.preferred - unpatched == config.refiner_blocks + 2 * config.blocks


def _sdpa(q, k, v):
    """A preferred attention: takes ComfyUI's tensor containers, returns [B, S, H*D]."""
    q, k, v = (t.take() if hasattr(t, "take") else t for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


@pytest.mark.parametrize("config", [CONFIGS[0], INT8], ids=["fp32", "int8_convrot"])
@pytest.mark.parametrize("lowvram", [False, True], ids=["loaded", "lowvram"])
def test_lora_on_off_on_reaches_the_helper(config, lowvram):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    budget = 1 if lowvram else None
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    base = run_like_sampler(patcher, inputs, lowvram_bytes=budget)
    on = run_like_sampler(lora, inputs, lowvram_bytes=budget)
    split_plain, split_lora = _sequence(patcher), _sequence(lora)
    runs = [run_like_sampler(p, inputs, lowvram_bytes=budget)
            for p in (split_lora, split_plain, split_lora, split_plain)]
    assert not _same(base, on)
    assert _same(runs[0], on) and _same(runs[2], on)
    assert _same(runs[1], base) and _same(runs[3], base)
    assert get_sequence_parallel(split_lora).steps["sequence"] == 2


def test_int8_bypass_lora_counts_what_upstream_computes():
    """A bypass LoRA on an INT8 ConvRot model: upstream's MLP runs fc2 inside
    `linear_input_act` (never `fc2.forward`), so fc2's adapter does not run unpatched; the split
    blocks compute the same (equal bits, no fc2 call) and the status says so, instead of
    counting the fc2 adapter's floor."""
    patcher = make_tiny_h3(INT8, seed=0)
    inputs = make_inputs(INT8, keyframe=True)
    lora_sd = make_lora_state_dict(patcher, rank=4, seed=3)
    try:
        bypass = with_bypass_lora(patcher, lora_sd)
    except RuntimeError as exc:  # ComfyUIUnavailable: a ComfyUI without bypass LoRA
        pytest.skip(str(exc))
    base = run_like_sampler(patcher, inputs)
    with CallCounter(bypass) as unpatched:
        reference = run_like_sampler(bypass, inputs)
    split = _sequence(bypass)
    with CallCounter(split) as counts:
        out = run_like_sampler(split, inputs)
    assert not _same(reference, base) and _same(out, reference)
    assert bypass_adapted_modules(split) == 4 * (INT8.blocks + INT8.refiner_blocks)
    assert unpatched.calls["mlp.fc2"] == counts.calls["mlp.fc2"] == 0
    assert counts.calls["mlp.fc1"] == 2 * INT8.blocks  # one call per device share
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1
    assert "fc2's on-activation LoRA does not run" in _status(split)


@pytest.mark.parametrize("with_dual_sage", [False, True], ids=["alone", "with_dual_sage"])
def test_under_dynamic_vram_the_mode_stays_off_and_says_why(with_dual_sage):
    """Under DynamicVRAM the helper weights would copy each module's unpatched host `weight`
    and its linears take ComfyUI's VBAR cast bound to the root (see the xfail GPU test): the
    mode stays off, each step runs on Dual-Sage's heads (when applied) or one device, exact,
    and the status says why. The patcher ComfyUI's loader returns then is a
    ModelPatcherDynamic, which exists on GPUs only: `is_dynamic()` stands in for it here."""
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage

    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    reference = run_like_sampler(lora, inputs)
    dynamic = lora.clone()
    dynamic.is_dynamic = lambda: True  # what ModelPatcherDynamic answers
    if with_dual_sage:
        dynamic = apply_dual_sage(dynamic, DualSageConfig(helpers=("cpu",), min_tokens=0))
        dynamic.is_dynamic = lambda: True
    split = _sequence(dynamic)
    out = run_like_sampler(split, inputs)
    assert _same(out, reference)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 0 and mode.blocks_run == 0 and mode.runner is None
    assert mode.steps["heads" if with_dual_sage else "off"] == 1
    assert _status(split).startswith(DYNAMIC_VRAM_OFF)
    assert _status(split).startswith("off: under DynamicVRAM the helper weights need "
                                     "ComfyUI-managed clones (not yet)")
    if with_dual_sage:
        shard = split.model_options["transformer_options"]["optimized_attention_override"]
        assert shard.sharded.routes["split"] == config.blocks  # Dual-Sage took the steps
    unload_all()


@pytest.mark.parametrize("order", ["sequence_last", "sequence_first"])
def test_composed_with_dual_sage_and_chunking(order):
    from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage

    config = WIDE[2]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    reference = run_like_sampler(lora, inputs)
    steps = [lambda p: apply_dual_sage(p, DualSageConfig(helpers=("cpu",), min_tokens=0)),
             lambda p: apply_activation_chunking(p, ChunkingConfig(ffn_chunk=23, qkv_chunk=23)),
             lambda p: _sequence(p)]
    if order == "sequence_first":
        steps = steps[::-1]
    patched = lora
    for step in steps:
        patched = step(patched)
    with CallCounter(patched) as counts:
        out = run_like_sampler(patched, inputs)
    assert _same(out, reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps["sequence"] == 1  # sequence took the step; Dual-Sage stood aside
    shard = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert shard.sharded.routes.get("split", 0) == 0
    # chunking ran inside each 45-row share (S = 90 with the keyframe): 23 + 22 rows
    assert counts.calls["mlp.fc1"] == 2 * 2 * config.blocks
