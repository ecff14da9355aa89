"""The pack beside ComfyUI's MultiGPU CFG Split (`guard.composition`).

CFG Split's clones are stood in for on the twin's patcher (`get_additional_models_with_key`
answering "multigpu" with flagged copies on other devices, as comfy/multigpu.py leaves them).
The pack's splitting or streaming DiT features are refused with CFG Split's name and the fix,
at the node when CFG Split comes first, and before the sampler runs (so before any weight
moves) when it comes after; the placement and device guard compose; at max_gpus 1 (no
clones) everything runs.
"""

from __future__ import annotations

import types

import pytest
import torch
from twin import TwinPatcher

from h3_multigpu.guard.composition import cfg_split_refusal
from h3_multigpu.guard.device import guard_diffusion_model, outer_sample_guard
from h3_multigpu.nodes.features import apply_from_strings


def _with_cfg_split(patcher, devices=("cuda:1",)):
    """`patcher` as MultiGPU CFG Split leaves it: a copy flagged per extra device."""
    clones = [types.SimpleNamespace(load_device=torch.device(d), is_multigpu_base_clone=True)
              for d in devices]
    patcher.get_additional_models_with_key = lambda key: list(clones) if key == "multigpu" else []
    return patcher


def _sample(patcher, calls=None):
    """The device guard's OUTER_SAMPLE wrapper around a sampler that counts its calls."""
    calls = [] if calls is None else calls
    executor = lambda *a, **k: calls.append(1) or "sampled"  # noqa: E731
    executor.class_obj = types.SimpleNamespace(model_patcher=patcher)
    return outer_sample_guard(executor), calls


def test_cfg_split_before_the_pack_refuses_at_the_node(tiny_twin):
    model = _with_cfg_split(TwinPatcher(tiny_twin))
    with pytest.raises(ValueError) as err:
        apply_from_strings(model, "chunking", ffn_chunk="8")
    text = str(err.value)
    assert "MultiGPU CFG Split" in text and "cpu, cuda:1" in text
    assert "max_gpus to 1" in text and "chunking off" in text


def test_cfg_split_after_the_pack_refuses_before_sampling(tiny_twin):
    chunked = apply_from_strings(TwinPatcher(tiny_twin), "chunking", ffn_chunk="8")
    split = _with_cfg_split(chunked.clone(), ("cuda:1", "cuda:2"))
    calls: list = []
    with pytest.raises(ValueError, match=r"MultiGPU CFG Split .* cpu, cuda:1, cuda:2"):
        _sample(split, calls)
    assert calls == []  # the sampler never ran: nothing was loaded or moved


def test_the_placement_and_guard_compose_with_cfg_split(tiny_twin):
    guarded = _with_cfg_split(guard_diffusion_model(TwinPatcher(tiny_twin).clone()))
    assert cfg_split_refusal(guarded) is None
    result, calls = _sample(guarded)
    assert result == "sampled" and calls == [1]


def test_without_clones_every_feature_runs(tiny_twin):
    chunked = apply_from_strings(TwinPatcher(tiny_twin), "chunking", ffn_chunk="8")
    chunked.get_additional_models_with_key = lambda key: []  # max_gpus 1 or one GPU
    result, calls = _sample(chunked)
    assert result == "sampled" and calls == [1]
