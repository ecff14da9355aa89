"""The sequence mode on real GPUs with ComfyUI-managed helper clones, legacy loader and DynamicVRAM.

Under DynamicVRAM ComfyUI's loader returns a `ModelPatcherDynamic`: weights stay on the host,
each module gets a VBAR allocation and is cast at op time, and a LoRA is a LowVramPatch applied
in that cast. The helper is ComfyUI's own clone of the model (`deepclone_multigpu`, matched to
the run's patcher, loaded by `load_models_gpu` as an additional model), so all of that is
ComfyUI's on the helper too. One H200 proves the plumbing (the helper is a second clone on the
same GPU: `same_gpu`); two GPUs run it for real.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m "comfyui and gpu" -o addopts="" \
        tests/test_sequence_dynamic_gpu.py
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfyui_h3 import (
    TinyH3Config,
    import_comfyui_or_skip,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    run_like_sampler,
    unload_all,
    with_lora,
)

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.sequence import (
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence import patches as sequence_patches
from h3_multigpu.sequence import status as sequence_status

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu]

CONFIG = TinyH3Config(hidden=1024, heads=8, head_dim=128, ffn=2048, blocks=2, refiner_blocks=1,
                      dtype=torch.bfloat16)
LATENT = (17, 48, 48)  # ~9.9k rows: shares above the 4,096-row GPU floor (bf16)
ROOT, HELPER = torch.device("cuda", 0), torch.device("cuda", 1)
_AIMDO: dict[str, bool] = {}


@pytest.fixture
def dynamic_vram():
    """DynamicVRAM switched on in this process as ComfyUI's main.py does it (comfy-aimdo's
    devices initialised, CoreModelPatcher = ModelPatcherDynamic, aimdo_enabled), restored after."""
    import_comfyui_or_skip()
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher

    dynamic_cls = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if dynamic_cls is None:
        pytest.skip("this ComfyUI has no ModelPatcherDynamic (DynamicVRAM)")
    try:
        import comfy_aimdo.control
    except ImportError as exc:
        pytest.skip(f"comfy-aimdo is not installed: {exc}")
    if "ok" not in _AIMDO:
        devices = comfy.model_management.get_all_torch_devices()
        try:
            _AIMDO["ok"] = bool(comfy_aimdo.control.init_devices((d.index, 0) for d in devices))
        except TypeError:  # comfy-aimdo 0.4.9's protocol
            _AIMDO["ok"] = bool(comfy_aimdo.control.init_devices(d.index for d in devices))
    if not _AIMDO["ok"]:
        pytest.skip("comfy-aimdo did not initialise on these GPUs")
    saved = (comfy.model_patcher.CoreModelPatcher, comfy.memory_management.aimdo_enabled)
    comfy.model_patcher.CoreModelPatcher = dynamic_cls
    comfy.memory_management.aimdo_enabled = True
    unload_all()
    yield
    unload_all()
    comfy.model_patcher.CoreModelPatcher, comfy.memory_management.aimdo_enabled = saved


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _models():
    patcher = make_tiny_h3(CONFIG, seed=0, load_device=ROOT)
    assert patcher.is_dynamic(), type(patcher).__name__  # what the loader picked
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=8, seed=3))
    inputs = make_inputs(CONFIG, latent_thw=LATENT, keyframe=True, audio_mask=True)
    return lora, inputs


def _split(patcher, helper=HELPER):
    return apply_sequence_parallel(patcher, SequenceParallelConfig(
        parallel="sequence", helpers=(str(helper),)))


def _same_gpu_split(patcher, monkeypatch):
    """The helper share on a second ComfyUI clone on the root's own GPU (plumbing only)."""
    from h3_multigpu.sequence import split as sequence_split

    monkeypatch.setattr(sequence_patches.policy, "resolve_devices",
                        lambda root, helpers, visible: [root, root])
    monkeypatch.setattr(sequence_split, "ALLOW_SHARED_GPU", True)
    return apply_sequence_parallel(patcher, SequenceParallelConfig(parallel="sequence"))


def _check(split, lora, inputs):
    reference = run_like_sampler(lora, inputs)
    out = run_like_sampler(split, inputs)
    assert _same(out, reference)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1 and mode.steps["fallback"] == 0, mode.steps
    assert mode.blocks_run == CONFIG.blocks and len(mode.bases) == 1
    line = protocol.status_lines(split)["sequence"]
    assert sequence_status.COMFY_CLONES in line, line
    return mode


@pytest.mark.multi_gpu
def test_under_dynamic_vram_the_helper_is_comfys_clone(dynamic_vram):
    lora, inputs = _models()
    with torch.cuda.device(ROOT):
        mode = _check(_split(lora), lora, inputs)
    assert mode.dynamic_vram
    (base,) = mode.bases.values()
    assert base.is_dynamic() and base.load_device == HELPER


@pytest.mark.parametrize("loader", ["legacy", "dynamic"])
def test_one_gpu_helper_clone_plumbing(request, monkeypatch, loader):
    if loader == "dynamic":
        request.getfixturevalue("dynamic_vram")
    else:
        import_comfyui_or_skip()
        memory = sys.modules.get("comfy.memory_management")
        if getattr(memory, "aimdo_enabled", False):
            pytest.skip("this session runs ComfyUI under DynamicVRAM (H3_DYNAMIC_VRAM=1): the "
                        "legacy loader's case runs in a session without it")
        unload_all()
    patcher = make_tiny_h3(CONFIG, seed=0, load_device=ROOT)
    assert patcher.is_dynamic() == (loader == "dynamic"), type(patcher).__name__
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=8, seed=3))
    inputs = make_inputs(CONFIG, latent_thw=LATENT, keyframe=True, audio_mask=True)
    with torch.cuda.device(ROOT):
        _check(_same_gpu_split(lora, monkeypatch), lora, inputs)
    unload_all()
