"""Placement and the latent upscaler's loader on real ComfyUI objects (CPU): core's patcher
class and reload factory, `deepclone_multigpu`, and `register_load_device` on every retarget.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_placement_comfyui.py

A DynamicVRAM patcher (`ModelPatcherDynamic`) cannot be built without a GPU (comfy-aimdo), so
`Core` stands in for it here the way main.py swaps it in: as `comfy.model_patcher.
CoreModelPatcher`, a real ModelPatcher that records `register_load_device` (the method only
ModelPatcherDynamic has). `tests/dynamic_vram_cases.py` runs the real one on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from h3_multigpu.upscale import build_from_state_dict, upscale_latent

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

NAME = "minimax_h3_latent_upscaler_small.safetensors"


@pytest.fixture
def core_patcher(monkeypatch):
    """ComfyUI's CoreModelPatcher swapped for a class that records device registrations."""
    import comfy.model_patcher as mp

    class Core(mp.ModelPatcher):
        registered: list = []

        def register_load_device(self, device):
            Core.registered.append(device)

    Core.registered = []
    monkeypatch.setattr(mp, "CoreModelPatcher", Core)
    return Core


@pytest.fixture
def upscaler_file(tmp_path, monkeypatch):
    """A small upscaler checkpoint (the community layout, `upscaler.` prefix) in ComfyUI's
    models/latent_upscale_models folder."""
    import folder_paths
    from test_upscale import small_state_dict

    folder = tmp_path / "latent_upscale_models"
    folder.mkdir()
    sd = small_state_dict(seed=0)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / NAME))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "latent_upscale_models",
                        ([str(folder)], {".safetensors"}))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    return sd


def load():
    from h3_multigpu.nodes.v3_upscale import H3MultiGPULatentUpscalerLoader

    return H3MultiGPULatentUpscalerLoader.execute(NAME).args[0]


def test_the_upscaler_loads_through_comfyuis_own_patcher_class(core_patcher, upscaler_file):
    import comfy.nested_tensor

    from h3_multigpu.nodes.v3_upscale import H3MultiGPULatentUpscale, load_upscaler_patcher

    upscaler = load()
    assert type(upscaler.patcher) is core_patcher  # dynamic whenever ComfyUI is
    assert upscaler.patcher.cached_patcher_init[0] is load_upscaler_patcher
    assert type(upscaler.patcher.clone()) is core_patcher
    # a non-dynamic copy when ComfyUI asks for one (clone(disable_dynamic=True))
    factory, args = upscaler.patcher.cached_patcher_init
    assert type(factory(*args, disable_dynamic=True)) is not core_patcher
    gen = torch.Generator().manual_seed(1)
    latent = {"samples": comfy.nested_tensor.NestedTensor(
        (torch.randn((1, 24, 2, 2, 3), generator=gen), torch.randn((1, 32, 2, 5), generator=gen)))}
    out = H3MultiGPULatentUpscale.execute(upscaler, latent, 96, 64).args[0]
    expected = upscale_latent(build_from_state_dict(upscaler_file).float(), latent, 96, 64)
    assert all(torch.equal(a, b) for a, b in zip(out["samples"].tensors,
                                                  expected["samples"].tensors, strict=True))


def test_placing_the_upscaler_is_cores_deepclone(core_patcher, upscaler_file):
    from h3_multigpu.nodes import comfy_placement

    upscaler = load()
    # gpu:0 is ComfyUI's CPU device on a GPU-less bed; gpu:1 is a device the upscaler is not on
    placed, note = comfy_placement.place_upscaler(upscaler, 1)
    target = comfy_placement.torch_device(1)
    assert note == "latent upscaler -> gpu:1 (deepclone_multigpu)", note
    assert placed.load_device == target and upscaler.load_device == torch.device("cpu")
    assert placed.patcher.model is not upscaler.patcher.model  # fresh weights from the factory
    assert type(placed.patcher) is core_patcher and target in core_patcher.registered


def test_a_retarget_without_a_reload_factory_registers_the_device(core_patcher):
    from h3_multigpu.nodes import comfy_placement

    cpu = torch.device("cpu")
    patcher = core_patcher(nn.Linear(4, 4), load_device=cpu, offload_device=cpu)
    target = torch.device("cuda", 1)
    placed, how = comfy_placement.retarget_patcher(patcher, target)
    assert how.startswith("load_device set on a clone (deepclone_multigpu refused")
    assert placed.load_device == target and patcher.load_device == cpu
    assert core_patcher.registered == [target]  # a DynamicVRAM patcher's pins for that device
