"""The prefetcher on the official INT8 ConvRot DiT inside a real ComfyUI (CPU): bit-identical to
ComfyUI unpatched, and ComfyUI's own cast uses each streamed INT8 weight as it is (no copy).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui \
        tests/test_offload_quantized_comfyui.py

The DiT comes from ComfyUI's loader (`TinyH3Config(weights="int8_convrot")`: each linear's
weight a comfy-kitchen `QuantizedTensor`, TensorWiseINT8Layout with ConvRot, as in
`minimax_h3_fl2va_pruned_int8_convrot`). The cast test streams the real modules to a slot on a
second device (`meta`, the only one a CPU machine has) and counts what ComfyUI's
`ops.cast_bias_weight` allocates; `tests/test_offload_int8_gpu.py` does the same on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import TinyH3Config, make_inputs, make_tiny_h3, run_like_sampler

from h3_multigpu.common.block_weights import is_quantized
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch
from h3_multigpu.offload.streamer import BlockStreamer, Source

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

INT8 = TinyH3Config(blocks=6, weights="int8_convrot", dtype=torch.bfloat16)
THREE_STEPS = (0.9, 0.6, 0.3, 0.0)
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_streamed_int8_convrot_equals_comfyui_unpatched():
    torch.set_num_threads(2)
    base = make_tiny_h3(INT8, seed=0)
    fc1 = base.model.diffusion_model.blocks[3].mlp.fc1
    assert is_quantized(fc1.weight) and fc1.weight._params.convrot  # the official format
    inputs = make_inputs(INT8, keyframe=True, audio_mask=True)
    ref = run_like_sampler(base, inputs, sigmas=THREE_STEPS)
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=1, lookahead=2))
    prefetch = get_block_prefetch(patched)
    own = {name: prefetch.module("blocks.3").get_submodule(name).weight for name in LINEARS}
    for _ in range(2):
        assert same(run_like_sampler(patched, inputs, sigmas=THREE_STEPS), ref)
    copies = prefetch.streamer.copies
    assert all(copies[f"blocks.{i}"] >= 3 for i in range(1, 6)), copies  # they streamed
    # between runs the modules hold their own objects, bound to the host copy, never dequantized
    host = prefetch.streamer.host["blocks.3"].flat
    for name, weight in own.items():
        assert prefetch.module("blocks.3").get_submodule(name).weight is weight
        assert host.data_ptr() <= weight._qdata.data_ptr() < host.data_ptr() + host.numel()
        assert weight._qdata.dtype == torch.int8


def test_comfyuis_cast_uses_a_streamed_int8_weight_as_it_is(monkeypatch):
    """Count what ComfyUI's `ops.cast_bias_weight` (the cast every INT8 linear runs, through
    its forward or `linear_input_act`) allocates for a weight streamed to another device."""
    import comfy.ops

    base = make_tiny_h3(INT8, seed=0)
    block = base.model.diffusion_model.blocks[2]
    linears = {name: block.get_submodule(name) for name in LINEARS}
    meta = torch.device("meta")
    streamer = BlockStreamer(linears, device=meta, lookahead=1, pinned_budget_bytes=None,
                             source=Source.AUTO)
    streamer.prepare()
    allocations = []
    empty_like = torch.empty_like

    def counted(*args, **kwargs):
        allocations.append(tuple(args[0].shape))
        return empty_like(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", counted)
    for name, linear in linears.items():
        streamer.begin(name)
        x = torch.empty((4, linear.in_features), dtype=linear.weight.dtype, device=meta)
        casts = [  # as the INT8 linear's weight-only forward, and as linear_input_act, call it
            dict(input=None, dtype=linear.weight.dtype, device=meta, bias_dtype=x.dtype),
            dict(input=x)]
        for kwargs in casts:
            weight, bias, offload = comfy.ops.cast_bias_weight(
                linear, offloadable=True, compute_dtype=x.dtype, want_requant=True, **kwargs)
            assert weight is linear.weight and weight.device == meta, name  # used as it is
            assert is_quantized(weight) and weight._qdata.dtype == torch.int8
            comfy.ops.uncast_bias_weight(linear, weight, bias, offload)
        streamer.end(name)
    assert allocations == []  # no copy of any weight (unfixed: one weight-sized copy each)
