"""ComfyUI's memory seams on real ComfyUI objects (CPU): the free-VRAM query every feature uses,
and the prefetcher's pinned host copies booked in ComfyUI's own pin budget.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_offload_memory_comfyui.py

There is no GPU here, so the only stand-ins are at the driver: the free-memory numbers
ComfyUI reads from torch / comfy-aimdo (`model_management.get_free_memory` and
`comfy_aimdo.model_vbar.vbars_analyze`) and CUDA's `cudaHostRegister` / `cudaHostUnregister`.
Everything between them and the pack (ModelPatcher.get_free_memory, LoadedModel,
model_management.pin_memory / unpin_memory and their bookkeeping) is ComfyUI's own code.
`tests/test_offload_comfyui_gpu.py` checks the same on a GPU without stand-ins.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from comfyui_h3 import (
    TinyH3Config,
    make_inputs,
    make_tiny_h3,
    record_cuda_pin_calls,
    run_like_sampler,
)

from h3_multigpu.comfy_seam import memory as comfy_memory
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.block_weights import module_bytes
from h3_multigpu.offload import (
    PrefetchConfig,
    apply_block_prefetch,
    get_block_prefetch,
    sizing,
)
from h3_multigpu.offload.streamer import BlockStreamer, Source

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

GIB = 1 << 30
CUDA0 = torch.device("cuda", 0)
TORCH_FREE = 5 * GIB  # what the driver reports free (torch.cuda.mem_get_info)
COMFY_FREE = 7 * GIB  # model_management.get_free_memory: driver free + torch's cached blocks
VBAR_EVICTABLE = 3 * GIB  # what comfy-aimdo could evict from its VBARs


@pytest.fixture
def free_memory(monkeypatch):
    """ComfyUI's free-memory readings on a machine with a (pretend) cuda:0, counted."""
    import comfy.model_management as mm
    import comfy_aimdo.model_vbar

    calls = {"comfy": 0, "vbars": 0}

    def get_free_memory(dev=None, torch_free_too=False):
        calls["comfy"] += 1
        return COMFY_FREE

    def vbars_analyze(index):
        calls["vbars"] += 1
        assert index == 0
        return VBAR_EVICTABLE

    def mem_get_info(device=None):
        raise AssertionError("torch's query was used inside ComfyUI")

    monkeypatch.setattr(mm, "get_free_memory", get_free_memory)
    monkeypatch.setattr(comfy_aimdo.model_vbar, "vbars_analyze", vbars_analyze)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def dynamic_vram_on(monkeypatch):
    """ComfyUI's DynamicVRAM switch, as main.py sets it (after any model is loaded here: with
    it on, ComfyUI's loader would memory-map through comfy-aimdo, which needs a GPU)."""
    import comfy.memory_management

    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)


def loaded_on_cuda0(monkeypatch):
    """A real ModelPatcher registered in ComfyUI's current_loaded_models on cuda:0 (which holds
    it weakly: keep the returned patcher)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    patcher = comfy.model_patcher.ModelPatcher(nn.Linear(4, 4), load_device=CUDA0,
                                               offload_device=torch.device("cpu"))
    monkeypatch.setattr(mm, "current_loaded_models", [mm.LoadedModel(patcher)])
    return patcher


def test_free_vram_is_comfyuis_count_with_dynamic_vram_evictable_memory(free_memory,
                                                                        monkeypatch):
    import comfy.model_patcher

    dynamic_vram_on(monkeypatch)
    patcher = comfy.model_patcher.ModelPatcher(nn.Linear(4, 4), load_device=CUDA0,
                                               offload_device=torch.device("cpu"))
    # the patcher's query: ComfyUI's free memory plus what DynamicVRAM could evict
    assert comfy_memory.free_vram_bytes(CUDA0, patcher) == COMFY_FREE + VBAR_EVICTABLE
    assert free_memory == {"comfy": 1, "vbars": 1}
    # no patcher and nothing loaded on the device: model_management's own query
    assert comfy_memory.free_vram_bytes(CUDA0) == COMFY_FREE
    # no patcher given: the one ComfyUI has loaded on the device answers
    loaded = loaded_on_cuda0(monkeypatch)  # noqa: F841 (ComfyUI holds it weakly)
    assert comfy_memory.free_vram_bytes(CUDA0) == COMFY_FREE + VBAR_EVICTABLE
    assert comfy_memory.free_vram_bytes("cpu") is None


def test_chunking_sequence_and_prefetch_ask_comfyui(free_memory, monkeypatch):
    """Every free-memory decision of the pack goes through ComfyUI's query."""
    from h3_multigpu.chunking.wrappers import free_device_bytes
    from h3_multigpu.sequence.helpers import _free_bytes

    base = make_tiny_h3(TinyH3Config(blocks=6), seed=0)
    dynamic_vram_on(monkeypatch)
    loaded = loaded_on_cuda0(monkeypatch)  # noqa: F841 (ComfyUI holds it weakly)
    assert free_device_bytes(CUDA0) == COMFY_FREE + VBAR_EVICTABLE  # chunking's auto sizes
    assert _free_bytes(CUDA0) == COMFY_FREE + VBAR_EVICTABLE  # sequence replica vs stream
    # the prefetcher's auto residency, asked with the patcher ComfyUI is about to load
    prefetch = get_block_prefetch(apply_block_prefetch(base, PrefetchConfig(
        resident_blocks="auto", activation_reserve_bytes=0)))
    prefetch.device = CUDA0  # where the budget is read; nothing runs
    before = dict(free_memory)
    assert prefetch._auto_resident(base) == prefetch.blocks  # 10 GiB free: all fit
    assert free_memory["vbars"] == before["vbars"] + 1


@pytest.fixture
def pin_driver(monkeypatch):
    """ComfyUI pinning on (a budget), with CUDA's registration calls recorded."""
    return record_cuda_pin_calls(monkeypatch)


class Block(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin(x))


def streamer_of(blocks, budget=None) -> BlockStreamer:
    # a CPU root that pins, as a GPU root does
    return BlockStreamer({f"b{i}": b for i, b in enumerate(blocks)}, device=torch.device("cpu"),
                         lookahead=1, pinned_budget_bytes=budget, source=Source.AUTO,
                         can_pin=True)


def test_host_copies_are_booked_in_comfyuis_pin_budget(pin_driver, monkeypatch):
    import comfy.model_management as mm

    blocks = [Block() for _ in range(6)]
    one = module_bytes(blocks[0])
    other = 3 * one  # pinned by ComfyUI itself (another model) before the prefetcher starts
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", other + 4 * one + 8192)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", other)
    streamer = streamer_of(blocks)
    streamer.prepare()
    stats = streamer.stats()
    # only what ComfyUI's budget had left: the staging ring first, then 2 blocks direct
    split = sizing.arena_split([one] * 6, 4 * one + 8192)
    assert stats["staged_blocks"] == split.staged_blocks == 4
    assert stats["booked_bytes"] == mm.TOTAL_PINNED_MEMORY - other > 0
    assert sum(pin_driver.values()) == mm.TOTAL_PINNED_MEMORY - other
    assert set(pin_driver) == set(mm.PINNED_MEMORY)  # ComfyUI's own record of each pin
    assert mm.TOTAL_PINNED_MEMORY <= mm.MAX_PINNED_MEMORY
    streamer.unpin()  # ComfyUI unloaded the model: the budget gets the bytes back
    assert mm.TOTAL_PINNED_MEMORY == other and not pin_driver
    streamer.prepare()
    assert mm.TOTAL_PINNED_MEMORY - other == streamer.stats()["booked_bytes"] > 0
    streamer.close()
    assert mm.TOTAL_PINNED_MEMORY == other and not pin_driver and not mm.PINNED_MEMORY


def test_a_smaller_requested_budget_is_kept_and_comfyuis_caps_a_larger_one(pin_driver,
                                                                          monkeypatch):
    import comfy.model_management as mm

    blocks = [Block() for _ in range(4)]
    one = module_bytes(blocks[0])
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 10 * one)
    assert comfy_memory.pin_budget_bytes(2 * one) == 2 * one
    assert comfy_memory.pin_budget_bytes(100 * one) == 10 * one
    assert comfy_memory.pin_budget_bytes(None) == 10 * one
    streamer = streamer_of(blocks, budget=100 * one)
    streamer.prepare()
    assert streamer.stats()["staged_blocks"] == 0  # 4 blocks fit in ComfyUI's 10
    streamer.close()


def test_no_pins_when_comfyui_pins_nothing(pin_driver, monkeypatch):
    """--disable-pinned-memory (MAX_PINNED_MEMORY = -1): nothing is page-locked, the blocks
    stream from pageable memory, and the outputs stay the same."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1)
    blocks = [Block() for _ in range(4)]
    x = torch.randn(3, 64)
    ref = x
    for b in blocks:
        ref = b(ref)
    streamer = streamer_of(blocks)
    streamer.prepare()
    out = x
    for i, b in enumerate(blocks):
        streamer.begin(f"b{i}")
        out = b(out)
        streamer.end(f"b{i}")
    assert torch.equal(out, ref)
    stats = streamer.stats()
    assert stats["pinned_bytes"] == 0 and stats["staged_blocks"] == 4 and not pin_driver
    assert mm.TOTAL_PINNED_MEMORY == 0
    streamer.close()


def test_status_names_comfyuis_pin_budget(monkeypatch):
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 40 * GIB)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 2 * GIB)
    cfg = TinyH3Config(blocks=6)
    base = make_tiny_h3(cfg, seed=0)
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=1))
    line = protocol.status_lines(patched)["prefetch"]
    assert "pinned budget ComfyUI's pin budget 40.0 GiB (2.0 GiB pinned now)" in line, line
    assert get_block_prefetch(patched).pinned_budget_bytes is None  # ComfyUI's, read when pinning
    ref = run_like_sampler(base, make_inputs(cfg))
    assert all(torch.equal(a, b) for a, b in zip(run_like_sampler(patched, make_inputs(cfg)),
                                                  ref, strict=True))


def test_plans_made_in_comfyui_use_its_loader_and_pin_budget(monkeypatch):
    import comfy.model_management as mm

    from h3_multigpu.nodes.planning import comfy_loader_inputs, make_plan

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 40 * GIB)
    base = make_tiny_h3(TinyH3Config(blocks=2), seed=0)  # ComfyUI's legacy ModelPatcher here
    assert comfy_loader_inputs("auto", base) == {"dynamic_vram": "off",
                                                 "pinned_budget_bytes": 40 * GIB}
    dynamic_vram_on(monkeypatch)
    assert comfy_loader_inputs("auto")["dynamic_vram"] == "on"  # what new models load with
    assert comfy_loader_inputs("auto", base)["dynamic_vram"] == "off"  # this one is legacy
    sizes = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                 seconds=10.0, lora_rank=128)
    # (devices 'auto' plans this machine's GPUs, which a CPU bed has none of: a profile stands
    # in; alone it would plan the legacy loader, ROCm 7.2)
    plan = make_plan(**sizes, devices="2xR9700", **comfy_loader_inputs("auto"))
    assert plan.loader.mode == "dynamic"  # the loader ComfyUI reports is the one planned
    assert plan.loader.pinned_budget_bytes == 40 * GIB
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1)  # --disable-pinned-memory
    assert comfy_loader_inputs("auto")["pinned_budget_bytes"] == 0
