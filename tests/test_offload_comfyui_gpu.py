"""The block prefetcher inside a real ComfyUI on GPUs: the real MiniMaxH3 (bf16) through the
real ModelPatcher and sampler, DiT on cuda:1 while cuda:0 is current, compared bit for bit
with ComfyUI's own unpatched output (run with cuda:1 current, as ComfyUI needs it).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m "comfyui and gpu" \
        tests/test_offload_comfyui_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch
from comfyui_h3 import (
    TinyH3Config,
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    run_like_sampler,
    unload_all,
    with_lora,
)

from h3_multigpu.comfy_seam.memory import free_vram_bytes
from h3_multigpu.common.arena import live_host_bytes
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.usefixtures("fresh_comfyui")]

# wide enough that block weights dominate memory (12 blocks of 34 MB bf16), quick to build
CFG = TinyH3Config(hidden=1024, heads=8, ffn=4096, blocks=12, refiner_blocks=2, text_dim=256,
                   dtype=torch.bfloat16)
STREAM = PrefetchConfig(resident_blocks=2, lookahead=2)  # 10 + 2 refiner blocks stream
ROOT = "cuda:1"
SIGMAS = (0.9, 0.6, 0.3, 0.0)


def inputs(conditioned: bool = True):
    return make_inputs(CFG, latent_thw=(3, 16, 16), audio_t=20, text_len=64,
                       keyframe=conditioned, audio_mask=conditioned)


def reference(patcher, data, **kwargs):
    with torch.cuda.device(1):  # ComfyUI unpatched needs its device current (issue 11, item 5)
        return run_like_sampler(patcher, data, sigmas=SIGMAS, **kwargs)


def streamed(patcher, data, **kwargs):
    with torch.cuda.device(0):  # the prefetcher makes cuda:1 current itself
        return run_like_sampler(patcher, data, sigmas=SIGMAS, **kwargs)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def dit_bytes(patcher) -> int:
    return sum(t.nelement() * t.element_size()
               for t in patcher.model.diffusion_model.state_dict().values())


@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "keyframe+audio_mask"])
def test_streamed_lora_cycles_equal_comfyui_on_cuda1(conditioned):
    base = make_tiny_h3(CFG, seed=0, load_device=ROOT)
    data = inputs(conditioned)
    sd = make_lora_state_dict(base, rank=8, seed=3)
    ref, ref_lora = reference(base, data), reference(with_lora(base, sd), data)
    unload_all()
    plain = apply_block_prefetch(base, STREAM)
    prefetch = get_block_prefetch(plain)
    lora = with_lora(plain, sd)
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora), (plain, ref)]:
        assert same(streamed(p, data), r)
    copies = prefetch.streamer.copies
    assert all(copies[f"blocks.{i}"] >= 5 * 3 for i in range(12) if f"blocks.{i}" in copies)
    assert copies["token_refiner.blocks.0"] == 5  # once per run
    assert prefetch.streamer.engine.copy_stream.device == torch.device(ROOT)


def test_streamed_lowvram_lora_equals_comfyui_lowvram_on_cuda1():
    base = make_tiny_h3(CFG, seed=0, load_device=ROOT)
    data = inputs()
    sd = make_lora_state_dict(base, rank=8, seed=3)
    plain = apply_block_prefetch(base, STREAM)
    prefetch = get_block_prefetch(plain)
    prefetch.ensure_resolved()
    budget = prefetch.device_footprint_bytes() // 3
    ref = reference(base, data, lowvram_bytes=budget), 0
    base_lora = with_lora(base, sd)
    ref_lora = reference(base_lora, data, lowvram_bytes=budget), lowvram_patched_modules(base_lora)
    assert ref_lora[1] > 0
    unload_all()
    lora = with_lora(plain, sd)
    # each run loads from unloaded with the same budget (the harness unloads cuda:1 too, though
    # cuda:0 is current): the same modules are lowvram (LowVramPatch on use) as ComfyUI's
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora)]:
        out = streamed(p, data, lowvram_bytes=budget)
        assert lowvram_patched_modules(p) == r[1]
        assert same(out, r[0])


def test_load_peak_and_memory_across_runs_unload_and_reload():
    base = make_tiny_h3(CFG, seed=0, load_device=ROOT)
    data = inputs()
    whole_dit = dit_bytes(base)
    reference(base, data)  # warm-up: kernels, cuBLAS workspace, ComfyUI's caches on cuda:1
    unload_all()
    gc.collect()
    torch.cuda.synchronize(ROOT)
    start_allocated = torch.cuda.memory_allocated(ROOT)
    start_pinned = live_host_bytes()[1]
    lora = with_lora(apply_block_prefetch(base, STREAM), make_lora_state_dict(base, rank=8))
    prefetch = get_block_prefetch(lora)
    torch.cuda.reset_peak_memory_stats(ROOT)
    streamed(lora, data)  # first load, with a LoRA patched into every streamed block
    peak = torch.cuda.max_memory_allocated(ROOT) - start_allocated
    footprint = prefetch.device_footprint_bytes()
    # ComfyUI's loader never held the whole DiT (nor its patched weights) on the device
    assert footprint < 0.5 * whole_dit and peak < 0.6 * whole_dit, (peak, footprint, whole_dit)
    assert lora.loaded_size() == lora.model_size() == footprint
    stats = prefetch.streamer.stats()
    assert stats["staged_blocks"] == 0 and stats["refused_pins"] == 0
    assert live_host_bytes()[1] - start_pinned == stats["pinned_bytes"] > 0  # page-locked
    torch.cuda.synchronize(ROOT)
    after_one = (torch.cuda.memory_allocated(ROOT), live_host_bytes())
    streamed(lora, data)  # two runs in a row
    torch.cuda.synchronize(ROOT)
    assert (torch.cuda.memory_allocated(ROOT), live_host_bytes()) == after_one
    unload_all()  # ComfyUI unloads: slots freed, host copies unpinned, resident part offloaded
    torch.cuda.synchronize(ROOT)
    assert torch.cuda.memory_allocated(ROOT) == start_allocated
    assert live_host_bytes()[1] == start_pinned
    streamed(lora, data)  # reload
    torch.cuda.synchronize(ROOT)
    assert (torch.cuda.memory_allocated(ROOT), live_host_bytes()) == after_one


def test_a_clone_without_the_prefetcher_runs_after_a_streamed_one():
    """Another clone of the same weights (no prefetcher) finds streamed blocks in host memory:
    ComfyUI's loader must move them for it instead of reusing the "loaded" model."""
    base = make_tiny_h3(CFG, seed=0, load_device=ROOT)
    data = inputs()
    ref = reference(base, data)
    plain = apply_block_prefetch(base, STREAM)
    assert same(streamed(plain, data), ref)
    assert same(reference(base, data), ref)
    assert same(streamed(plain, data), ref)


def test_auto_residency_decided_before_the_load_streams_what_does_not_fit():
    base = make_tiny_h3(CFG, seed=0, load_device=ROOT)
    data = inputs()
    ref = reference(base, data)
    unload_all()
    block = max(t.nelement() * t.element_size()
                for t in [base.model.diffusion_model.blocks[0].mlp.fc1.weight]) * 2
    free = free_vram_bytes(ROOT, base)  # the query the prefetcher's 'auto' asks (ComfyUI's)
    # leave room for about 6 of the 12 blocks: 'auto' keeps 2-3 resident beside the 3 slots
    config = PrefetchConfig(activation_reserve_bytes=max(0, free - 6 * block))
    patcher = apply_block_prefetch(base, config)
    prefetch = get_block_prefetch(patcher)
    assert same(streamed(patcher, data), ref)
    assert 0 < len(prefetch.resident) < 12 and prefetch.streamed_ids
    assert all(prefetch.streamer.copies[b] >= 3 for b in prefetch.streamed_ids
               if b.startswith("blocks."))
