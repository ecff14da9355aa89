"""The drop-in node's status on a real ComfyUI (CPU): true of this server, whatever `devices`.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_status_comfyui.py

On a CPU server `devices='auto'` passes every model through unchanged and says NOT ACTIVE; a
profile name gets its plan as a preview that says it is not this machine; the model line is the
loaded DiT's own (block count, weight format) and the graph line the prompt's passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "api" / \
    "h3_multigpu_two_pass_t2v.json"
SIZES = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
             seconds=5.0, lora_rank=128)


@pytest.fixture
def tiny_int8():
    from comfyui_h3 import TinyH3Config, make_tiny_h3

    return make_tiny_h3(TinyH3Config(weights="int8_convrot", blocks=3), seed=0)


def _prompt():
    prompt = json.loads(WORKFLOW.read_text())
    node = next(k for k, n in prompt.items() if n["class_type"] == "H3MultiGPU")
    return prompt, node


def test_auto_on_a_cpu_server_passes_everything_through_and_says_why(tiny_int8):
    from h3_multigpu.nodes.v3_dropin import run_dropin

    clip, vae, audio_vae, upscaler = object(), object(), object(), object()
    prompt, node = _prompt()
    clones = []
    original_clone = type(tiny_int8).clone
    type(tiny_int8).clone = lambda self, *a, **k: clones.append(1) or original_clone(self, *a,
                                                                                        **k)
    try:
        *out, plan, status, placement = run_dropin(
            tiny_int8, clip, vae, audio_vae, upscaler, None, {**SIZES, "devices": "auto"},
            prompt=prompt, node_id=node)
    finally:
        type(tiny_int8).clone = original_clone
    assert out[0] is tiny_int8 and out[1:] == [clip, vae, audio_vae, upscaler]
    assert clones == [] and plan is None and placement.root is None
    lines = status.splitlines()
    assert lines[0] == ("H3 Multi-GPU: NOT ACTIVE: this server has no GPU that ComfyUI computes "
                        "on; the models pass through unchanged and ComfyUI runs them on its own "
                        "defaults")
    assert lines[1].startswith("this server: no GPU that ComfyUI computes on")
    assert "loader: ComfyUI's legacy ModelPatcher" in lines
    assert ("model: 3 blocks, INT8 ConvRot weights (the official H3 DiT has 50 blocks: the "
            "plan's sizes and times are for those 50)") in lines
    assert "graph: 2 sampling passes with this pack's H3 Latent Upscale between them" in lines
    assert "predicted peak" not in status and "DiT + sampler" not in status


def test_a_profile_on_a_cpu_server_is_a_preview_of_that_profile(tiny_int8):
    from h3_multigpu.nodes.v3_dropin import run_dropin

    *out, plan, status, _ = run_dropin(tiny_int8, None, None, None, None, None,
                                       {**SIZES, "devices": "1x5090"})
    assert out[0] is tiny_int8 and plan is not None and plan.profile.name == "1x5090"
    head = status.splitlines()[0]
    assert head.startswith("H3 Multi-GPU: NOT ACTIVE: this server has no GPU")
    assert head.endswith("; plan for profile 1x5090 (NVIDIA GeForce RTX 5090 32 GiB), not this "
                         "machine (fits)")
    assert "predicted peak profile 1x5090 gpu:0 " in status
    assert "predicted peak gpu:" not in status  # never as if it were this server's GPU
    # planned for the loaded model's format (INT8 ConvRot), not a default
    assert plan.request.dit_dtype == "int8"
    assert "graph:" not in status  # no prompt: nothing said of a graph


def test_a_one_pass_graph_is_planned_and_described_as_one_pass():
    from comfyui_h3 import TinyH3Config, make_tiny_h3

    from h3_multigpu.nodes.v3_dropin import run_dropin

    bf16 = make_tiny_h3(TinyH3Config(), seed=0)
    prompt, node = _prompt()
    # the official one-pass form: the upscale and the second sampler cut out
    upscale = next(k for k, n in prompt.items() if n["class_type"] == "H3MultiGPULatentUpscale")
    first = prompt[upscale]["inputs"]["samples"][0]
    for key in [k for k, n in prompt.items() if n["class_type"] in (
            "H3MultiGPULatentUpscale", "SamplerCustomAdvanced") and k != first]:
        del prompt[key]
    *_, plan, status, _ = run_dropin(bf16, None, None, None, None, None,
                                     {**SIZES, "devices": "2xR9700"}, prompt=prompt,
                                     node_id=node)
    assert "graph: one sampling pass, no latent upscale" in status.splitlines()
    assert plan.request.pass1_steps == 0 and plan.job_time.upscale_s == 0.0
    assert "latent upscale:" not in status and "model: 2 blocks, fp32 weights" in status


def test_the_plan_node_names_its_own_input_on_a_cpu_server():
    from h3_multigpu.nodes.v3_plan import H3MultiGPUPlan

    with pytest.raises(ValueError, match=r"^devices='auto': this server has no GPU that ComfyUI "
                                         r"computes on .*set devices to a profile name"):
        H3MultiGPUPlan.execute(devices="auto", **SIZES)


@pytest.mark.gpu
def test_on_a_gpu_the_plan_and_the_status_use_comfyuis_budget(tiny_int8, monkeypatch):
    """One GPU emulating a 32 GiB card (torch's per-process fraction) with ComfyUI told to keep
    more free (--reserve-vram): the status names that budget and the plan is made for it."""
    import torch

    from h3_multigpu.comfy_seam import runtime
    from h3_multigpu.nodes import comfy_placement
    from h3_multigpu.nodes.v3_dropin import run_dropin

    # only the DiT is loaded here: the other components pass (placing them is tested elsewhere)
    monkeypatch.setattr(comfy_placement, "place_clip", lambda c, i: (c, "text encoder: kept"))
    monkeypatch.setattr(comfy_placement, "place_vae", lambda v, i, w: (v, f"{w}: kept"))
    GiB = 1024**3
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    torch.cuda.set_per_process_memory_fraction(32 * GiB / total, 0)
    monkeypatch.setattr(runtime.model_management(), "EXTRA_RESERVED_VRAM", int(total - 30 * GiB))
    try:
        *_, plan, status, placement = run_dropin(
            tiny_int8, None, None, None, None, None, {**SIZES, "devices": "auto"})
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)
    assert placement.root == 0
    head, device_line = status.splitlines()[:2]
    assert head.startswith("H3 Multi-GPU: active on 1 GPU; plan for this server (")
    assert device_line.startswith("this server: 1 GPU: gpu:0 ")
    assert ", ComfyUI may use 30.0 of " in device_line and "torch memory fraction" in device_line
    assert "(--reserve-vram)" in device_line
    assert plan.gpus[0].capacity_bytes == 30 * GiB
    assert "predicted peak gpu:0 " in status and " of 30.0 GiB" in status
