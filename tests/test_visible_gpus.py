"""The GPUs the pack uses are the ones ComfyUI uses (`comfy_seam.devices.gpu_count`).

ComfyUI started with `--cuda-device 0`, or on Windows without `--cuda-device all` (newer core),
lists fewer GPUs than torch may see. Here torch is made to see two GPUs and a stand-in
`comfy.model_management` lists one or two: every feature's device list and check follows
ComfyUI's, and a helper ComfyUI does not see is refused with the start flag that fixes it.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from h3_multigpu.comfy_seam import devices
from h3_multigpu.common.devices import validate_devices
from h3_multigpu.decode import apply as decode_apply


@pytest.fixture
def two_torch_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _comfyui_lists(monkeypatch, count: int) -> list[int]:
    calls: list[int] = []

    def get_all_torch_devices(exclude_current=False):
        calls.append(1)
        return [torch.device("cuda", i) for i in range(count)]

    mm = types.ModuleType("comfy.model_management")
    mm.get_all_torch_devices = get_all_torch_devices
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    return calls


def test_outside_comfyui_torch_count_stands(two_torch_gpus, monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    assert devices.gpu_count() == 2
    validate_devices(torch.device("cuda", 0), [torch.device("cuda", 1)])


def test_a_gpu_comfyui_does_not_see_is_refused_with_the_flag(two_torch_gpus, monkeypatch):
    calls = _comfyui_lists(monkeypatch, 1)
    assert devices.gpu_count() == 1 and calls
    with pytest.raises(ValueError) as err:
        validate_devices(torch.device("cuda", 0), [torch.device("cuda", 1)])
    text = str(err.value)
    assert "cuda:1" in text and "hidden from ComfyUI" in text and "--cuda-device all" in text
    # auto helpers follow ComfyUI's list too: the decode finds no helper to share with
    config = decode_apply.MultiGPUDecodeConfig()
    assert decode_apply._helper_devices(config, torch.device("cuda", 0)) == []


def test_both_gpus_listed_by_comfyui_are_used(two_torch_gpus, monkeypatch):
    _comfyui_lists(monkeypatch, 2)
    assert devices.gpu_count() == 2
    validate_devices(torch.device("cuda", 0), [torch.device("cuda", 1)])
    config = decode_apply.MultiGPUDecodeConfig()
    assert decode_apply._helper_devices(config, torch.device("cuda", 0)) == [
        torch.device("cuda", 1)]


def test_a_gpu_nobody_sees_is_named_as_missing(two_torch_gpus, monkeypatch):
    _comfyui_lists(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"gpu:3 does not exist: this machine has 2 GPU"):
        validate_devices(torch.device("cuda", 0), [torch.device("cuda", 3)])
