"""The in-process ComfyUI H3 harness works: the real MiniMaxH3 through the real ModelPatcher and
sampler path is deterministic, and ComfyUI's weight-patch LoRA applies and comes off bit for bit.

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_comfyui_h3_bed.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import (
    AttentionCounter,
    TinyH3Config,
    import_comfyui_or_skip,
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    preferred_attention_missing,
    run_like_sampler,
    set_preferred_attention,
    with_lora,
)

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

CONFIGS = [TinyH3Config(adaln="curve"), TinyH3Config(adaln="full")]
# the official DiT format: INT8 ConvRot block linears, bf16 elsewhere (ComfyUI's loader)
INT8 = TinyH3Config(adaln="curve", weights="int8_convrot", dtype=torch.bfloat16)
ALL = CONFIGS + [INT8]


def _id(config: TinyH3Config) -> str:
    return config.adaln if config.weights == "float" else config.weights


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("config", ALL, ids=_id)
@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "keyframe+audio_mask"])
def test_unpatched_runs_are_bit_identical(config, conditioned):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=conditioned, audio_mask=conditioned)
    with AttentionCounter() as calls:
        first = run_like_sampler(patcher, inputs)
    second = run_like_sampler(patcher, inputs)
    assert first[0].shape == (1, 24, 3, 4, 6) and first[1].shape == (1, 32, 2, 5)
    assert torch.isfinite(first[0]).all() and torch.isfinite(first[1]).all()
    assert _same(first, second)
    # the refiner runs once in extra_conds, each DiT block once in the single model call
    assert calls.entered == calls.default == config.refiner_blocks + config.blocks


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.adaln)
def test_conditioning_reaches_the_model(config):
    patcher = make_tiny_h3(config, seed=0)
    plain = run_like_sampler(patcher, make_inputs(config))
    keyed = run_like_sampler(patcher, make_inputs(config, keyframe=True))
    masked = run_like_sampler(patcher, make_inputs(config, audio_mask=True))
    assert not torch.equal(plain[0], keyed[0])   # keyframe rows join the packed sequence
    assert not torch.equal(plain[1], masked[1])  # kept audio frames run at their own timestep


@pytest.mark.parametrize("config", ALL, ids=_id)
def test_lora_on_off_on_cycles_bit_for_bit(config):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    base = run_like_sampler(patcher, inputs)
    on = run_like_sampler(lora, inputs)
    off = run_like_sampler(patcher, inputs)
    on_again = run_like_sampler(lora, inputs)
    off_again = run_like_sampler(patcher, inputs)
    assert not torch.equal(base[0], on[0]) and not torch.equal(base[1], on[1])
    assert _same(base, off) and _same(base, off_again)
    assert _same(on, on_again)


def test_lowvram_lora_matches_full_load_lora():
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    full = run_like_sampler(lora, inputs)
    lowvram = run_like_sampler(lora, inputs, lowvram_bytes=1)
    assert lowvram_patched_modules(lora) > 0  # ComfyUI's LowVramPatch carried the LoRA
    # the on-the-fly patch runs the same calculate_weight as the in-place patch: bit-identical
    assert _same(lowvram, full)
    base = run_like_sampler(patcher, inputs)
    assert lowvram_patched_modules(patcher) == 0
    assert not torch.equal(base[0], full[0])


def test_attention_counter_sees_overrides():
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config)
    base = run_like_sampler(patcher, inputs)
    seen = []

    def override(func, *args, **kwargs):
        seen.append(func)
        return func(*args, **kwargs)

    overridden = patcher.clone()
    overridden.model_options.setdefault("transformer_options", {})[
        "optimized_attention_override"] = override
    with AttentionCounter() as calls:
        out = run_like_sampler(overridden, inputs)
    # overrides reach the DiT forward only (the refiner runs in extra_conds, without them)
    assert len(seen) == config.blocks
    assert calls.default == config.refiner_blocks + config.blocks
    assert _same(out, base)


def test_the_startup_flags_kernel_is_what_h3_calls():
    """Every release: H3 calls the `optimized_attention` ComfyUI picked at startup (a flag's
    kernel here: negated basic attention, whose output differs from the CPU default on any
    CPU), and an override is handed that kernel as `func`. Only a release with per-module
    preferred attention passes `preferred_attention=` (0.33.0 does not)."""
    from comfyui_h3 import negated_basic_attention

    import_comfyui_or_skip()
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config)
    default = run_like_sampler(patcher, inputs)
    basic = negated_basic_attention()
    seen = []

    def override(func, *args, **kwargs):
        seen.append(func)
        return func(*args, **kwargs)

    overridden = patcher.clone()
    overridden.model_options.setdefault("transformer_options", {})[
        "optimized_attention_override"] = override
    with AttentionCounter(kernel=basic) as calls:
        flagged = run_like_sampler(patcher, inputs)
        through_override = run_like_sampler(overridden, inputs)
    assert not _same(flagged, default) and _same(through_override, flagged)
    assert calls.default == 2 * (config.refiner_blocks + config.blocks)
    # the kernel itself (behind the counter's count)
    assert len(seen) == config.blocks and all(f.__wrapped__ is basic.__wrapped__ for f in seen)
    passes_preferred = {"preferred_attention" in kw for kw in calls.keywords}
    assert passes_preferred == {preferred_attention_missing(patcher) is None}


def test_attention_counter_sees_preferred_attention():
    comfy = import_comfyui_or_skip()
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    missing = preferred_attention_missing(patcher)
    if missing:
        pytest.skip(missing)
    inputs = make_inputs(config)
    sub_quad = comfy.ldm.modules.attention.attention_sub_quad
    with AttentionCounter() as calls:
        set_preferred_attention(patcher, calls.count_preferred(sub_quad))
        try:
            run_like_sampler(patcher, inputs)
        finally:
            set_preferred_attention(patcher, None)
    assert calls.preferred == config.refiner_blocks + config.blocks
    assert calls.default == 0
