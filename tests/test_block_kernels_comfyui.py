"""Plan and run agree on the block's kernels inside a real ComfyUI: a random-weight H3 checkpoint
(bf16 and the official INT8 ConvRot) loaded by ComfyUI's own loader; the kernels the planner
used for that job are the ones the chunking reads off the loaded block at run time, and the
planner's block peak is the run's sizing for the same shape.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_block_kernels_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import TinyH3Config, make_tiny_h3

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking, sizing
from h3_multigpu.comfy_seam import h3 as seam_h3
from h3_multigpu.planner import PlanRequest, plan_job
from h3_multigpu.planner.memory import ROPE_BYTES_PER_TOKEN, block_activation_peak
from h3_multigpu.planner.request import DIT_WEIGHT_FORMATS

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

CONFIGS = {"bf16": TinyH3Config(heads=8, dtype=torch.bfloat16),
           "int8": TinyH3Config(heads=8, weights="int8_convrot", dtype=torch.bfloat16)}


@pytest.mark.parametrize("dit_dtype", sorted(CONFIGS))
def test_plan_and_run_read_the_same_kernels(dit_dtype):
    config = CONFIGS[dit_dtype]
    patcher = make_tiny_h3(config, seed=0)
    block = patcher.get_model_object("diffusion_model").blocks[0]
    # the checkpoint is the format the job names (what the planner plans with)
    assert seam_h3.weight_format(block.mlp.fc2) == DIT_WEIGHT_FORMATS[dit_dtype]
    plan = plan_job(PlanRequest(dit_dtype=dit_dtype, profile="2xH200", lora_rank=0),
                    suggest=False)
    chunked = apply_activation_chunking(patcher, ChunkingConfig(ffn_chunk=64, qkv_chunk=64))
    chunker = get_chunking(chunked).chunkers[0]
    run = chunker.kernels()  # what the chunking sizes the block with at run time
    assert plan.kernels == run == sizing.Kernels.of(patcher)
    assert run.mlp == ("comfy_int8" if dit_dtype == "int8" else "comfy")
    assert seam_h3.fused_int8_fc2(block) == (dit_dtype == "int8")
    # the same shape, the same peak: the planner's block model and the run's sizing
    tokens = 4 * 1024
    x = torch.zeros(tokens, config.hidden, dtype=config.dtype)
    dims = chunker.dims(x)
    planned = block_activation_peak(tokens, dims, kernels=plan.kernels)
    ran = sizing.block_peak_bytes(tokens, dims, adapters=chunker.adapters(), kernels=run)
    assert (planned.attention_bytes, planned.mlp_bytes) == (ran.attention_bytes, ran.mlp_bytes)
    assert planned.peak_bytes == ran.peak_bytes + tokens * ROPE_BYTES_PER_TOKEN
