"""The legacy-loader prefetcher on one GPU inside a real ComfyUI: the official INT8 ConvRot DiT
streamed with 0 extra weight copies, bit-identical to ComfyUI unpatched, its host copies booked
in ComfyUI's pin budget; free VRAM read through ComfyUI on an emulated 32 GB card.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -m "comfyui and gpu" \
        -o addopts="--strict-markers" tests/test_offload_int8_gpu.py

ComfyUI is imported in-process without DynamicVRAM (the harness does not enable it), so its
loader is the legacy ModelPatcher: the case ROCm below 7.14 and --disable-dynamic-vram run.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import TinyH3Config, make_inputs, make_tiny_h3, run_like_sampler, unload_all

from h3_multigpu.comfy_seam.memory import free_vram_bytes
from h3_multigpu.common.block_weights import is_quantized
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu, pytest.mark.usefixtures("fresh_comfyui")]

DEV = "cuda:0"
# fc1 1024 -> 8192 holds 8 MiB of INT8: large enough that a copy per call shows in the counts
CFG = TinyH3Config(hidden=1024, heads=8, ffn=4096, blocks=12, refiner_blocks=2, text_dim=256,
                   dtype=torch.bfloat16, weights="int8_convrot")
STREAM = PrefetchConfig(resident_blocks=2, lookahead=2)  # 10 + 2 refiner blocks stream
SIGMAS = (0.9, 0.6, 0.3, 0.0)


def inputs():
    return make_inputs(CFG, latent_thw=(3, 16, 16), audio_t=20, text_len=64, keyframe=True,
                       audio_mask=True)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def weight_copies(monkeypatch):
    """Every copy ComfyUI's cast (`model_management.cast_to`) makes of a quantized weight."""
    import comfy.model_management as mm

    copies: list[int] = []
    original = mm.cast_to

    def cast_to(weight, *args, **kwargs):
        out = original(weight, *args, **kwargs)
        if is_quantized(weight) and out is not weight:
            copies.append(weight._qdata.nbytes)
        return out

    monkeypatch.setattr(mm, "cast_to", cast_to)
    return copies


def test_streamed_int8_blocks_are_used_in_their_slots_without_copies(weight_copies):
    import comfy.model_management as mm

    base = make_tiny_h3(CFG, seed=0, load_device=DEV)
    if base.is_dynamic():
        pytest.skip("the legacy loader's streaming; this session runs DynamicVRAM "
                    "(H3_DYNAMIC_VRAM=1)")
    data = inputs()
    ref = run_like_sampler(base, data, sigmas=SIGMAS)
    assert weight_copies == []  # stock ComfyUI: every weight on the GPU, used as it is
    unload_all()
    pinned_before = mm.TOTAL_PINNED_MEMORY
    patched = apply_block_prefetch(base, STREAM)
    prefetch = get_block_prefetch(patched)
    for _ in range(2):
        assert same(run_like_sampler(patched, data, sigmas=SIGMAS), ref)
    copies = prefetch.streamer.copies
    assert all(copies[f"blocks.{i}"] >= 3 for i in range(12) if f"blocks.{i}" in copies)
    # unfixed: one copy of every streamed INT8 weight on every call (+8 MiB per fc1 call)
    assert weight_copies == [], f"{len(weight_copies)} copies, {sum(weight_copies)} bytes"
    stats = prefetch.streamer.stats()
    if mm.MAX_PINNED_MEMORY > 0:  # ComfyUI pins (not --disable-pinned-memory)
        assert mm.TOTAL_PINNED_MEMORY - pinned_before == stats["booked_bytes"] > 0
        assert stats["booked_bytes"] >= stats["pinned_bytes"]  # whole pages
    unload_all()  # ComfyUI unloads the model: its budget gets the pages back
    assert mm.TOTAL_PINNED_MEMORY == pinned_before


def test_free_vram_is_comfyuis_and_respects_an_emulated_32gb_card():
    import comfy.model_management as mm

    device = torch.device(DEV)
    torch.cuda.init()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, (32 << 30) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        keep = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB in use
        free = free_vram_bytes(device)
        assert free <= int(total * fraction) - torch.cuda.memory_reserved(device)
        assert free <= mm.get_free_memory(device)  # ComfyUI's count, capped by the fraction
        del keep
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert free_vram_bytes(device) == mm.get_free_memory(device)  # nothing loaded: ComfyUI's
