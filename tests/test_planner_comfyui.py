"""Inside a real ComfyUI the plan is timed with the attention ComfyUI runs: its
`optimized_attention` (chosen by --use-sage-attention, --use-flash-attention, --use-ck-attention,
else PyTorch SDPA), or the checkpoint's preferred kernel (the newest files' ComfyAttention).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_planner_comfyui.py
"""

from __future__ import annotations

import pytest
from comfyui_h3 import TinyH3Config, make_tiny_h3

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

SIZES = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
             seconds=10.0, lora_rank=128)


@pytest.mark.parametrize("function,kernel", [("attention_pytorch", "sdpa"),
                                             ("attention_sage", "sage"),
                                             ("attention_flash", "flash"),
                                             ("attention_comfy_kitchen_int8", "ck")])
def test_the_plan_is_timed_with_comfyuis_attention(monkeypatch, function, kernel):
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention

    from h3_multigpu.nodes import planning
    from h3_multigpu.nodes.planning import comfy_attention, make_plan
    from h3_multigpu.planner import get_profile

    if not hasattr(attention, function):
        pytest.skip(f"this ComfyUI has no {function}")
    # H3's module imported optimized_attention by name: that copy is what its blocks call
    monkeypatch.setattr(h3, "optimized_attention", getattr(attention, function))
    assert comfy_attention() == kernel
    # devices 'auto' is this machine (a CPU bed has no GPU): two H200s stand in for it
    monkeypatch.setattr(planning, "this_server_profile", lambda: get_profile("2xH200"))
    plan = make_plan(**SIZES, devices="auto")
    assert plan.attention.kernel == kernel and plan.attention.requested == kernel
    # a profile name previews other hardware with its own defaults, not this ComfyUI's
    assert make_plan(**SIZES, devices="2xH200").attention.kernel == "sdpa"


def test_the_checkpoints_preferred_attention_is_planned(monkeypatch):
    import comfy.ldm.modules.attention as attention

    from h3_multigpu.nodes.planning import checkpoint_attention, comfy_loader_inputs

    base = make_tiny_h3(TinyH3Config(blocks=2), seed=0)
    assert checkpoint_attention(base) is None  # no attention config in this checkpoint
    assert "attention" not in comfy_loader_inputs("auto", base)
    module = getattr(base.model.diffusion_model.blocks[0].attn, "comfy_attention", None)
    if module is None:
        pytest.skip("this ComfyUI has no per-module ComfyAttention (0.33.0)")
    monkeypatch.setattr(module, "function", attention.attention_comfy_kitchen_int8)
    assert checkpoint_attention(base) == "ck"
    assert comfy_loader_inputs("auto", base)["attention"] == "ck"
