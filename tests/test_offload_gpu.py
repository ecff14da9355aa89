"""Block streaming on a real GPU: exact outputs, memory saved as predicted, budget fallback.

Run on the device machine: `pytest -m gpu tests/test_offload_gpu.py` (and `-m multi_gpu` for
the root-on-cuda:1 case).
"""

from __future__ import annotations

import pytest
import torch
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin

from h3_multigpu.common.block_weights import module_bytes
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch, sizing

# wide enough that weights dominate memory, small enough to build in a second
MEDIUM = TwinConfig.tiny(hidden=1024, heads=8, head_dim=128, ffn=2816, blocks=12,
                         refiner_blocks=1, text_dim=256)


def build(cfg: TwinConfig, device: str, dtype=torch.bfloat16):
    model = make_twin(cfg, dtype=dtype, device=device, seed=0)
    inputs = make_inputs(cfg, latent_t=3, latent_h=16, latent_w=16, audio_t=20, text_len=32,
                         dtype=dtype, device=device, seed=1)
    return model, inputs


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("lookahead,resident,source", [
    (1, 0, "auto"), (2, 0, "auto"), (3, 0, "auto"), (2, 4, "auto"), (2, 0, "pageable")])
def test_streamed_is_bit_identical_on_cuda(lookahead, resident, source):
    model, inputs = build(MEDIUM, "cuda")
    base = TwinPatcher(model)
    ref = base.apply_model(*inputs)
    patched = apply_block_prefetch(base, PrefetchConfig(
        resident_blocks=resident, lookahead=lookahead, source=source))
    for _ in range(3):
        assert same(patched.apply_model(*inputs), ref)
    prefetch = get_block_prefetch(patched)
    stats = prefetch.streamer.stats()
    assert stats["streamed_blocks"] == 12 - resident + 1
    if source == "auto":
        host = prefetch.streamer.host["blocks.1"]
        # page-locked in place with cudaHostRegister (torch's is_pinned() may not report it)
        assert host.pinned and not host.staged and stats["pinned_bytes"] >= host.flat.numel()
    else:
        assert stats["staged_blocks"] == stats["streamed_blocks"]
    prefetch.close()
    assert same(base.apply_model(*inputs), ref)


@pytest.mark.gpu
def test_peak_memory_falls_by_about_the_predicted_amount():
    model, inputs = build(MEDIUM, "cuda")
    base = TwinPatcher(model)
    base.apply_model(*inputs)  # warm kernels and workspaces in both cases
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ref = base.apply_model(*inputs)
    torch.cuda.synchronize()
    resident_peak = torch.cuda.max_memory_allocated()

    resident, lookahead = 2, 2
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=resident,
                                                        lookahead=lookahead))
    prefetch = get_block_prefetch(patched)
    prefetch.prepare()  # moves the streamed blocks to host memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = patched.apply_model(*inputs)
    torch.cuda.synchronize()
    streamed_peak = torch.cuda.max_memory_allocated()
    assert same(out, ref)

    block = module_bytes(model.blocks[0])
    refiner = module_bytes(model.token_refiner.blocks[0])
    streamed = MEDIUM.blocks - resident
    # all streamed bytes leave the device, the slot ring (sized for the largest block) arrives
    predicted = streamed * block + refiner - sizing.slot_ring_bytes(block, lookahead, streamed + 1)
    assert predicted > 5 * block
    saved = resident_peak - streamed_peak
    assert streamed_peak < resident_peak
    assert 0.8 * predicted <= saved <= 1.2 * predicted, (saved, predicted)
    prefetch.close()


@pytest.mark.gpu
def test_out_of_budget_arena_falls_back_to_staging():
    model, inputs = build(MEDIUM, "cuda")
    base = TwinPatcher(model)
    ref = base.apply_model(*inputs)
    block = module_bytes(model.blocks[0])
    patched = apply_block_prefetch(base, PrefetchConfig(
        resident_blocks=0, lookahead=2, pinned_budget_bytes=5 * block))
    for _ in range(2):
        assert same(patched.apply_model(*inputs), ref)
    stats = get_block_prefetch(patched).streamer.stats()
    # 2 staging buffers + 3 pinned blocks fill the budget; the other 10 blocks are staged
    assert stats["staged_blocks"] == 10 and stats["host_direct_bytes"] <= 3 * block
    assert stats["pinned_bytes"] <= 5 * block
    get_block_prefetch(patched).close()


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_root_on_second_gpu_keeps_streams_there():
    model, inputs = build(MEDIUM, "cuda:1")
    base = TwinPatcher(model, load_device="cuda:1")
    with torch.cuda.device(1):  # the plain twin, like ComfyUI, needs its device current
        ref = base.apply_model(*inputs)
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=3, lookahead=2))
    with torch.cuda.device(0):  # a current device other than the root must not matter
        for _ in range(2):
            assert same(patched.apply_model(*inputs), ref)
    streamer = get_block_prefetch(patched).streamer
    assert streamer.engine.copy_stream.device == torch.device("cuda:1")
    assert all(s.device == torch.device("cuda:1") for s in streamer.slots.buffers)
    get_block_prefetch(patched).close()
