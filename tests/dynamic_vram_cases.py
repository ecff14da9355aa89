"""ComfyUI with DynamicVRAM (comfy-aimdo) on a GPU: what ComfyUI does with the H3 DiT, and what
the pack plans and reports for it. The loader is ComfyUI's own (UNETLoader's path), the patcher
`ModelPatcherDynamic`, the outputs compared bit for bit with stock ComfyUI under DynamicVRAM.

DynamicVRAM has to be switched on before ComfyUI is imported, so these run in a process of
their own (not collected by default: the name is not test_*):

    H3_DYNAMIC_VRAM=1 COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -p no:cacheprovider \
        -o addopts="--strict-markers" -m "comfyui and gpu" tests/dynamic_vram_cases.py

`tests/test_dynamic_vram_gpu.py` starts that process from a normal GPU run.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from comfyui_h3 import (
    ComfyUIUnavailable,
    TinyH3Config,
    enable_dynamic_vram,
    make_inputs,
    make_tiny_h3,
    run_like_sampler,
)

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.comfy_seam.memory import free_vram_bytes
from h3_multigpu.guard.device import guard_diffusion_model
from h3_multigpu.nodes.devices import gpu_inventory
from h3_multigpu.nodes.features import apply_plan
from h3_multigpu.nodes.placement import placement_from_plan
from h3_multigpu.nodes.planning import comfy_loader_inputs, make_plan
from h3_multigpu.nodes.status import compose_status
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu]

DEV = "cuda:0"
FLOAT = TinyH3Config(hidden=1024, heads=8, ffn=4096, blocks=12, refiner_blocks=2,
                     text_dim=256, dtype=torch.bfloat16)
INT8 = TinyH3Config(hidden=1024, heads=8, ffn=4096, blocks=12, refiner_blocks=2,
                    text_dim=256, dtype=torch.bfloat16, weights="int8_convrot")
SIGMAS = (0.9, 0.6, 0.3, 0.0)
SIZES = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
             seconds=10.0, lora_rank=128)


@pytest.fixture(scope="module", autouse=True)
def dynamic_vram():
    if os.environ.get("H3_DYNAMIC_VRAM") != "1":
        pytest.skip("DynamicVRAM cases run in a process of their own: set H3_DYNAMIC_VRAM=1 "
                    "(tests/test_dynamic_vram_gpu.py does)")
    try:
        return enable_dynamic_vram()
    except ComfyUIUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def unloaded(dynamic_vram):
    from comfyui_h3 import unload_all

    unload_all()
    yield
    unload_all()


def inputs(cfg):
    return make_inputs(cfg, latent_thw=(3, 16, 16), audio_t=20, text_len=64, keyframe=True,
                       audio_mask=True)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("cfg", [FLOAT, INT8], ids=["bf16", "int8_convrot"])
def test_comfyui_streams_and_the_prefetcher_says_so(cfg):
    base = make_tiny_h3(cfg, seed=0, load_device=DEV)
    assert type(base).__name__ == "ModelPatcherDynamic" and base.is_dynamic()
    data = inputs(cfg)
    ref = run_like_sampler(base, data, sigmas=SIGMAS)  # stock ComfyUI under DynamicVRAM
    assert torch.device(DEV) in base.model.dynamic_vbars  # ComfyUI's VBAR on the device
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=2))
    line = protocol.status_lines(patched)["prefetch"]
    assert line.startswith("off: ComfyUI's DynamicVRAM streams this model's weights")
    assert f"streaming: ComfyUI DynamicVRAM (comfy-aimdo VBAR on {DEV}" in line
    assert "make_prefetch_queue" in line or "block prefetch is off" in line
    assert get_block_prefetch(patched) is None  # nothing of the pack's streamer installed
    assert same(run_like_sampler(patched, data, sigmas=SIGMAS), ref)


def test_the_plan_and_the_status_describe_dynamic_vram():
    import comfy.model_management as mm

    base = make_tiny_h3(FLOAT, seed=0, load_device=DEV)
    loader = comfy_loader_inputs("auto", base)
    assert loader["dynamic_vram"] == "on"
    assert loader["pinned_budget_bytes"] == max(int(mm.MAX_PINNED_MEMORY), 0)
    plan = make_plan(**SIZES, devices="auto", **loader)  # this machine's GPUs
    assert plan.loader.mode == "dynamic" and plan.prefetch.streamer == "comfyui"
    report = plan.report()
    assert "loader: ComfyUI DynamicVRAM (comfy-aimdo" in report
    # the report wraps at 100 columns: compare its words
    assert "ComfyUI's MAX_PINNED_MEMORY" in " ".join(report.split())
    placement = placement_from_plan(plan, gpu_inventory())
    model, lines = apply_plan(base, plan, placement, disabled=("dual_sage", "sequence"))
    assert "streaming: ComfyUI DynamicVRAM" in lines["prefetch"]
    status = compose_status(placement=placement, plan=plan, features=lines)
    assert "prefetch: off: ComfyUI's DynamicVRAM streams this model's weights" in status
    data = inputs(FLOAT)
    ref = run_like_sampler(base, data, sigmas=SIGMAS)
    assert same(run_like_sampler(model, data, sigmas=SIGMAS), ref)


def test_free_vram_counts_what_dynamic_vram_can_evict():
    import comfy.model_management as mm

    from h3_multigpu.chunking.wrappers import free_device_bytes

    base = make_tiny_h3(FLOAT, seed=0, load_device=DEV)
    run_like_sampler(base, inputs(FLOAT), sigmas=SIGMAS)  # the DiT now sits in its VBAR
    device = torch.device(DEV)
    torch.cuda.synchronize(device)
    ours = free_vram_bytes(device, base)
    assert ours == base.get_free_memory(device)  # ComfyUI's query, aimdo's evictable included
    assert ours >= mm.get_free_memory(device)
    assert free_device_bytes(device) == ours  # chunking asks the loaded patcher too
    assert ours >= torch.cuda.mem_get_info(device)[0]  # torch's query alone sees no more


def test_the_upscaler_is_dynamic_and_computes_what_a_legacy_one_does(tmp_path, monkeypatch):
    import comfy.model_management as mm
    import comfy.nested_tensor
    import folder_paths
    from safetensors.torch import save_file
    from test_upscale import small_state_dict

    from h3_multigpu.nodes import comfy_placement
    from h3_multigpu.nodes.v3_upscale import (
        H3MultiGPULatentUpscale,
        H3MultiGPULatentUpscalerLoader,
        PackUpscaler,
        load_upscaler_patcher,
    )

    folder = tmp_path / "latent_upscale_models"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in small_state_dict(seed=0).items()},
              str(folder / "up.safetensors"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "latent_upscale_models",
                        ([str(folder)], {".safetensors"}))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    dit = make_tiny_h3(FLOAT, seed=0, load_device=DEV)
    run_like_sampler(dit, inputs(FLOAT), sigmas=(0.9, 0.0))  # the DiT is loaded on the GPU
    upscaler = H3MultiGPULatentUpscalerLoader.execute("up.safetensors").args[0]
    assert type(upscaler.patcher).__name__ == "ModelPatcherDynamic"
    placed, note = comfy_placement.place_upscaler(upscaler, 0)
    assert placed.patcher.is_dynamic(), note
    gen = torch.Generator().manual_seed(1)
    latent = {"samples": comfy.nested_tensor.NestedTensor(
        (torch.randn((1, 24, 2, 4, 6), generator=gen), torch.randn((1, 32, 2, 5), generator=gen)))}
    out = H3MultiGPULatentUpscale.execute(placed, latent, 192, 128).args[0]
    # ComfyUI freed memory for it the dynamic way: the DiT was not evicted
    assert any(lm.model is dit for lm in mm.current_loaded_models)
    assert placed.patcher.partially_unload_ram(1 << 20) >= 0  # its pin state exists
    legacy = PackUpscaler(load_upscaler_patcher(str(folder / "up.safetensors"),
                                                disable_dynamic=True), "up.safetensors")
    assert not legacy.patcher.is_dynamic()
    expected = H3MultiGPULatentUpscale.execute(legacy, latent, 192, 128).args[0]
    assert same(out["samples"].tensors, expected["samples"].tensors)


@pytest.mark.multi_gpu
def test_a_dynamic_patcher_placed_without_a_factory_keeps_working_on_its_new_gpu():
    import comfy.model_patcher

    from h3_multigpu.nodes import comfy_placement

    patcher = comfy.model_patcher.ModelPatcherDynamic(
        nn.Linear(64, 64), load_device=torch.device("cuda", 0),
        offload_device=torch.device("cpu"))
    placed, how = comfy_placement.retarget_patcher(patcher, torch.device("cuda", 1))
    assert how.startswith("load_device set on a clone") and placed.is_dynamic()
    assert torch.device("cuda", 1) in placed.model.dynamic_pins
    assert placed.partially_unload_ram(1 << 20) == 0  # unfixed: KeyError cuda:1


@pytest.mark.parametrize("lora", ["none", "weight", "bypass"])
@pytest.mark.parametrize("cfg", [FLOAT, INT8], ids=["bf16", "int8_convrot"])
def test_chunking_under_dynamic_vram_equals_unpatched(cfg, lora):
    """DynamicVRAM casts each weight at op time from its VBAR (a LoRA is a LowVramPatch applied
    there): the chunk wrappers run upstream's modules per chunk, so each chunk's call casts and
    patches as the whole call would; the output is ComfyUI's own."""
    from comfyui_h3 import make_lora_state_dict, with_bypass_lora, with_lora

    from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking

    base = make_tiny_h3(cfg, seed=0, load_device=DEV)
    assert base.is_dynamic()
    if lora != "none":
        sd = make_lora_state_dict(base, rank=16, seed=3)
        base = with_lora(base, sd) if lora == "weight" else with_bypass_lora(base, sd)
    data = inputs(cfg)
    ref = run_like_sampler(base, data, sigmas=SIGMAS)
    # S = 64 text + 40 audio + 3 x 64 video + 64 keyframe rows: chunks of 1 (INT8) or 4096
    # rows would not split; these explicit sizes do (the status says where they may differ)
    chunked = guard_diffusion_model(apply_activation_chunking(base, ChunkingConfig(
        ffn_chunk=128, qkv_chunk=96, head_group=4)))
    out = run_like_sampler(chunked, data, sigmas=SIGMAS)
    calls = sum(c.calls["mlp"] for c in get_chunking(chunked).chunkers.values())
    assert calls > len(SIGMAS[:-1]) * cfg.blocks  # more than one chunk per block call
    line = protocol.status_lines(chunked)["chunking"]
    if line.endswith("; exact"):
        assert same(out, ref)
    else:  # bf16 chunks below the GPU's floors: within bf16 rounding of the unchunked run
        for a, b in zip(out, ref, strict=True):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2, line
