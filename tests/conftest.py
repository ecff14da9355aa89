"""Shared fixtures: a tiny twin (CPU), seeded inputs, and skips for marked tests."""

from __future__ import annotations

import os

import pytest
import torch
from twin import TwinConfig, make_inputs, make_twin


def pytest_configure(config):
    """H3_DYNAMIC_VRAM=1: this whole session runs ComfyUI with DynamicVRAM (comfy-aimdo), as
    its main.py switches it on by default on NVIDIA; it must happen before anything imports
    ComfyUI. Without it the session runs ComfyUI's legacy loader."""
    if os.environ.get("H3_DYNAMIC_VRAM") == "1" and os.environ.get("COMFYUI_PATH"):
        from comfyui_h3 import ComfyUIUnavailable, enable_dynamic_vram

        try:
            enable_dynamic_vram()
        except ComfyUIUnavailable as exc:
            raise pytest.UsageError(f"H3_DYNAMIC_VRAM=1 but DynamicVRAM is off: {exc}") from exc


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA/ROCm GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))
        if ("comfyui" in item.keywords or "browser" in item.keywords) and not os.environ.get(
                "COMFYUI_PATH"):
            item.add_marker(pytest.mark.skip(reason="set COMFYUI_PATH to a ComfyUI checkout"))


@pytest.fixture
def two_cpu_threads():
    """Two CPU threads, as ComfyUI runs on a CPU: the exactness rules (row floors, heads per
    call, `common/exactness.py`: a head subset needs 2 heads then) are measured with them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_comfyui():
    """The in-process ComfyUI of COMFYUI_PATH (else skip), every model unloaded before and
    after the test."""
    from comfyui_h3 import import_comfyui_or_skip, unload_all

    import_comfyui_or_skip()
    unload_all()
    yield
    unload_all()


@pytest.fixture
def tiny_config() -> TwinConfig:
    return TwinConfig.tiny()


@pytest.fixture
def tiny_twin(tiny_config):
    return make_twin(tiny_config, seed=0)


@pytest.fixture
def tiny_inputs(tiny_config):
    # S = 16 text + 2*5 audio + 3*2*3 video = 44 tokens
    return make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)
