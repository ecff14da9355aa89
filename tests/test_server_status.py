"""The status line is true of this server: its GPUs and ComfyUI's budget on each, its loader, the
loaded model and the graph's passes (`nodes/server.py`, `comfy_seam.memory.vram_budget`)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from h3_multigpu.comfy_seam import memory
from h3_multigpu.nodes import devices
from h3_multigpu.nodes.devices import GpuInfo
from h3_multigpu.nodes.placement import decide_placement
from h3_multigpu.nodes.server import GraphPasses, ModelFacts, ServerFacts, graph_passes
from h3_multigpu.nodes.status import compose_status

GiB = 1024**3
WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows" / "api"


def _pack_node(prompt: dict) -> str:
    return next(k for k, n in prompt.items() if n["class_type"] == "H3MultiGPU")


@pytest.mark.parametrize("name", ["t2v", "i2v", "r2v"])
def test_a_bundled_two_pass_graph_has_two_passes_and_the_packs_upscale(name):
    prompt = json.loads((WORKFLOWS / f"h3_multigpu_two_pass_{name}.json").read_text())
    passes = graph_passes(prompt, _pack_node(prompt))
    assert passes == GraphPasses(2, "this pack's H3 Latent Upscale")
    assert passes.describe() == ("graph: 2 sampling passes with this pack's H3 Latent Upscale "
                                 "between them")


def test_a_one_pass_graph_says_one_pass_and_no_upscale():
    prompt = json.loads((WORKFLOWS / "h3_multigpu_two_pass_t2v.json").read_text())
    node = _pack_node(prompt)
    # cut the graph to its first sampler: drop the upscale, the second pass and what follows
    upscale = next(k for k, n in prompt.items() if n["class_type"] == "H3MultiGPULatentUpscale")
    first = prompt[upscale]["inputs"]["samples"][0]
    for key in [k for k, n in prompt.items() if n["class_type"] in
                ("SamplerCustomAdvanced", "H3MultiGPULatentUpscale") and k != first]:
        del prompt[key]
    passes = graph_passes(prompt, node)
    assert passes == GraphPasses(1, None) and passes.one_pass
    assert passes.describe() == "graph: one sampling pass, no latent upscale"
    # samplers that do not descend from the node are not its passes
    prompt["99"] = {"class_type": "KSampler", "inputs": {}}
    assert graph_passes(prompt, node).samplers == 1
    assert graph_passes(prompt, "missing") is None and graph_passes(None, node) is None


def test_a_model_of_another_size_is_said_and_plan_lines_about_50_blocks_are_qualified():
    facts = ServerFacts(gpus=(), model=ModelFacts(4, "int8_convrot"))
    assert facts.model.describe().startswith("model: 4 blocks, INT8 ConvRot weights (the "
                                             "official H3 DiT has 50 blocks")
    assert facts.qualify("all 50 blocks fit on the root GPU") == (
        "all 50 blocks (of the official DiT; this model has 4) fit on the root GPU")
    official = ServerFacts(gpus=(), model=ModelFacts(50, "bfloat16"))
    assert official.model.describe() == "model: 50 blocks, bf16 weights"
    assert official.qualify("all 50 blocks fit") == "all 50 blocks fit"
    assert ModelFacts(50, "bfloat16").plan_dtype() == "bf16"
    assert ModelFacts(50, "int8_convrot").plan_dtype() == "int8"
    assert ModelFacts(50, "fp8").plan_dtype() is None


def test_no_gpu_status_says_not_active_and_names_no_gpu():
    facts = ServerFacts(gpus=(), loader="legacy", model=ModelFacts(4, "bfloat16"),
                        passes=GraphPasses(1, None))
    text = compose_status(placement=decide_placement([]), server=facts,
                          inactive="this server has no GPU that ComfyUI computes on")
    lines = text.splitlines()
    assert lines[0].startswith("H3 Multi-GPU: NOT ACTIVE: this server has no GPU that ComfyUI "
                               "computes on; the models pass through unchanged")
    assert lines[1].startswith("this server: no GPU that ComfyUI computes on")
    assert "loader: ComfyUI's legacy ModelPatcher" in lines
    assert "graph: one sampling pass, no latent upscale" in lines
    assert "predicted peak" not in text and "PASS1" not in text and "Upscale" not in text


def test_the_device_line_shows_comfyuis_budget_where_it_is_below_the_card():
    gpu = GpuInfo(0, "NVIDIA H200", 140 * GiB)
    facts = ServerFacts(gpus=(gpu,), budgets={0: "31.8 of 140.0 GiB (torch memory fraction "
                                                  "0.229: 32.0 GiB)"}, loader="DynamicVRAM")
    assert facts.device_line() == ("this server: 1 GPU: gpu:0 NVIDIA H200 140 GiB, ComfyUI may "
                                   "use 31.8 of 140.0 GiB (torch memory fraction 0.229: 32.0 "
                                   "GiB)")
    assert facts.loader_line().startswith("loader: ComfyUI's DynamicVRAM")


class _Props:
    total_memory = 140 * GiB


def test_vram_budget_takes_the_memory_fraction_and_reserve_vram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.25,
                        raising=False)
    monkeypatch.setitem(sys.modules, "comfy.model_management",
                        types.SimpleNamespace(EXTRA_RESERVED_VRAM=int(108 * GiB)))
    budget = memory.vram_budget(0)
    assert budget.total_bytes == 140 * GiB
    assert budget.budget_bytes == 32 * GiB  # min(140 * 0.25, 140 - 108)
    assert budget.describe() == ("32.0 of 140.0 GiB (torch memory fraction 0.25: 35.0 GiB; "
                                 "ComfyUI keeps 108.0 GiB free (--reserve-vram))")
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0)
    monkeypatch.setitem(sys.modules, "comfy.model_management",
                        types.SimpleNamespace(EXTRA_RESERVED_VRAM=0))
    assert memory.vram_budget(0).limits == () and memory.vram_budget(0).describe() == \
        "all 140.0 GiB"


def test_a_cpu_comfyui_has_no_gpus_even_where_torch_sees_some(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H200",
                                                        total_memory=140 * GiB))
    monkeypatch.setitem(sys.modules, "comfy.model_management",
                        types.SimpleNamespace(get_torch_device=lambda: torch.device("cpu")))
    assert devices.gpu_inventory() == []  # ComfyUI --cpu
    monkeypatch.setitem(sys.modules, "comfy.model_management",
                        types.SimpleNamespace(get_torch_device=lambda: torch.device("cuda", 0)))
    assert [g.name for g in devices.gpu_inventory()] == ["NVIDIA H200"]


def test_devices_auto_without_a_gpu_names_the_nodes_input(monkeypatch):
    from h3_multigpu.nodes import planning

    monkeypatch.setattr(devices, "gpu_inventory", lambda: [])
    with pytest.raises(ValueError) as caught:
        planning.make_plan(pass2_width=1312, pass2_height=736, pass1_width=864,
                           pass1_height=480, seconds=5.0, devices="auto", lora_rank=0)
    message = str(caught.value)
    assert message.startswith("devices='auto': this server has no GPU that ComfyUI computes on")
    assert "set devices to a profile name (" in message and "2xR9700" in message
    assert "--profile" not in message  # the CLI's flag is not the node's input


def test_devices_auto_plans_for_comfyuis_budget_not_the_card(monkeypatch):
    """On an H200 with ComfyUI keeping all but 32 GiB free, the plan sees 32 GiB."""
    from h3_multigpu.nodes import planning
    from h3_multigpu.planner import hardware

    monkeypatch.setattr(devices, "gpu_inventory", lambda: [GpuInfo(0, "NVIDIA H200", 140 * GiB)])
    profile = hardware.HardwareProfile(
        "auto", "this machine: 1 GPU(s)",
        (hardware.replace(hardware.H200, memory_bytes=140 * GiB),), hardware.get_profile(
            "1x5090").link, 64 * GiB)
    monkeypatch.setattr(hardware, "detect_hardware", lambda: profile)
    monkeypatch.setattr(memory, "vram_budget", lambda index: memory.VramBudget(
        index, 140 * GiB, 32 * GiB, ("ComfyUI keeps 108.0 GiB free (--reserve-vram)",)))
    plan = planning.make_plan(pass2_width=1312, pass2_height=736, pass1_width=864,
                              pass1_height=480, seconds=5.0, devices="auto", lora_rank=0)
    assert plan.gpus[0].capacity_bytes == 32 * GiB
    assert plan.profile.name == "auto"
    text = compose_status(placement=decide_placement([GpuInfo(0, "NVIDIA H200", 140 * GiB)]),
                          plan=plan)
    assert "plan for this server (" in text and "of 32.0 GiB" in text
    assert "not this machine" not in text


def test_a_one_pass_graph_plans_one_pass(monkeypatch):
    from h3_multigpu.nodes import planning

    plan = planning.make_plan(pass2_width=1312, pass2_height=736, pass1_width=864,
                              pass1_height=480, seconds=5.0, devices="2xR9700", lora_rank=0,
                              one_pass=True, model_request={"dit_dtype": "bf16"})
    assert plan.request.pass1_steps == 0 and plan.request.dit_dtype == "bf16"
    assert plan.job_time.upscale_s == 0.0
