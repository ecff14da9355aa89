"""The block's kernels have one answer, `comfy_seam.h3.block_kernels`: the chunking reads it off
the loaded block at run time, the planner asks it for upstream H3's block before anything is
loaded. (On a real ComfyUI tree: tests/test_block_kernels_comfyui.py.)"""

from __future__ import annotations

import pytest
from twin import TwinConfig, make_twin

from h3_multigpu.chunking.sizing import Kernels
from h3_multigpu.comfy_seam import h3 as seam_h3
from h3_multigpu.planner import PlanRequest, plan_job
from h3_multigpu.planner.request import DIT_WEIGHT_FORMATS


@pytest.mark.parametrize("fmt,mlp", [("bfloat16", "comfy"), ("float16", "comfy"),
                                     ("fp8", "comfy"), ("int8", "comfy_int8"),
                                     ("int8_convrot", "comfy_int8")])
def test_without_a_model_the_seam_answers_upstreams_block(fmt, mlp):
    # upstream's MLP is linear_input_act's SwiGLU; the INT8 layouts run it fused into fc2
    assert seam_h3.block_kernels(weight_format=fmt) == (mlp, True)
    assert Kernels.of(weight_format=fmt) == Kernels(mlp=mlp, attention_output_copy=True)


def test_product_defaults_are_upstreams_block_never_the_twin():
    assert Kernels() == Kernels.of() and Kernels().mlp != "twin"


@pytest.mark.parametrize("dit_dtype", sorted(DIT_WEIGHT_FORMATS))
def test_the_plan_uses_the_kernels_of_its_weight_format(dit_dtype):
    plan = plan_job(PlanRequest(dit_dtype=dit_dtype, profile="2xH200"), suggest=False)
    assert plan.kernels == Kernels.of(weight_format=DIT_WEIGHT_FORMATS[dit_dtype])
    assert plan.kernels.mlp == ("comfy_int8" if dit_dtype == "int8" else "comfy")


def test_a_loaded_model_is_read_off_its_block():
    twin = make_twin(TwinConfig.tiny(), seed=0)
    # the twin answers with its own kernel, through the model, the DiT or one block alike
    assert seam_h3.block_kernels(twin).mlp == "twin"
    assert seam_h3.block_kernels(twin.blocks[0]) == seam_h3.block_kernels(twin)
    with pytest.raises(ValueError, match="no H3 DiT block"):
        seam_h3.block_kernels(object())
