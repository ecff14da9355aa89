"""The sequence-parallel mode on ComfyUI's real MiniMax H3 through the real ModelPatcher.

CPU stand-in devices (every "GPU" is the CPU), ComfyUI's own sampler path, attention function,
LoRA patching and lowvram loading: the result must equal ComfyUI's unpatched output bit for bit.

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_sequence_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import (
    AttentionCounter,
    TinyH3Config,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    run_like_sampler,
    set_preferred_attention,
    with_lora,
)

from h3_multigpu.sequence import (
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)

pytestmark = pytest.mark.comfyui

CONFIGS = [TinyH3Config(adaln="curve"), TinyH3Config(adaln="full", heads=4)]


@pytest.fixture(autouse=True)
def _one_thread(fresh_comfyui):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU BLAS row splits are exact single-threaded (see test_sequence)
    yield
    torch.set_num_threads(threads)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _sequence(patcher, **kwargs):
    kwargs.setdefault("chunk_heads", 1)
    return apply_sequence_parallel(patcher, SequenceParallelConfig(
        parallel="sequence", helpers=("cpu",), **kwargs))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.adaln)
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
    status = split.model_options["transformer_options"]["h3_multigpu"]["sequence"]
    assert "sequence parallel sequence" in status


def test_preferred_attention_is_sharded_not_replaced():
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
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


@pytest.mark.parametrize("lowvram", [False, True], ids=["loaded", "lowvram"])
def test_lora_on_off_on_reaches_the_helper(lowvram):
    config = CONFIGS[0]
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
