"""Chunking on ComfyUI's own H3 block (`comfy.ldm.minimax.model`), with ComfyUI's bypass LoRA.

Runs only with COMFYUI_PATH set to a ComfyUI checkout that has the MiniMax H3 model. A small
block built with `comfy.ops` layers, on the device ComfyUI picks, must give bit-identical
results chunked and unchunked, with a LoRA injected through ComfyUI's `BypassForwardHook`.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import import_comfyui_or_skip

from h3_multigpu.chunking import ChunkingConfig
from h3_multigpu.chunking.block import ChunkedBlockForward
from h3_multigpu.chunking.h3_ops import H3Ops, activation_adapters

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy_h3():
    # skips with the reason when ComfyUI cannot be imported here at all (missing requirements,
    # RuntimeError from a GPU-less machine, no H3 model)
    comfy = import_comfyui_or_skip()
    try:
        from comfy.weight_adapter.bypass import BypassForwardHook
        from comfy.weight_adapter.lora import LoRAAdapter
    except ImportError as exc:  # a ComfyUI without bypass LoRA
        pytest.skip(f"this ComfyUI has no bypass LoRA (comfy.weight_adapter.bypass): {exc}")

    h3 = comfy.ldm.minimax.model
    return h3, comfy.ops, comfy.model_management, BypassForwardHook, LoRAAdapter


def _block(comfy_h3, device):
    h3, ops, *_ = comfy_h3
    torch.manual_seed(0)
    block = h3.DiTBlock(64, 8, 16, 96, 8, 1e-5, 1e-5, apply_silu=False,
                        adaln_dtype=torch.float32, dtype=torch.bfloat16, device=device,
                        operations=ops.disable_weight_init)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    return block.eval()


def test_ops_resolve_to_comfyui_functions(comfy_h3):
    h3 = comfy_h3[0]
    ops = H3Ops.for_block(_block(comfy_h3, "cpu"))
    assert ops.is_comfyui and ops.optimized_attention is h3.optimized_attention
    assert ops.mlp_kernel(torch.nn.Linear(2, 2)) == "comfy"


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "bypass-lora"])
def test_comfyui_block_chunked_is_bit_identical(comfy_h3, lora):
    h3, _, mm, bypass_hook, lora_adapter = comfy_h3
    device = mm.get_torch_device()
    block = _block(comfy_h3, device)
    hooks = []
    if lora:
        for linear in (block.attn.qkv_proj, block.mlp.fc1):
            gen = torch.Generator().manual_seed(linear.out_features)
            up = torch.randn(linear.out_features, 4, generator=gen) * 0.1
            down = torch.randn(4, linear.in_features, generator=gen) * 0.1
            adapter = lora_adapter(set(), (up, down, 4.0, None, None, None))
            hook = bypass_hook(linear, adapter, multiplier=0.7)
            hook.inject()
            hooks.append(hook)
        assert activation_adapters(block.attn.qkv_proj) == (1, 4)
    # 8,200 rows: GEMM chunks of >= 1,000 rows and >= 128 query tiles per head (see sizing)
    s = 8200
    x = torch.randn(s, 64, dtype=torch.bfloat16, device=device)
    t_emb = torch.randn(2, 8, device=device)
    segments = [(0, 300, 1), (300, 1300, 5), (1300, s, 0)]
    rope = h3.rope_rotation_table(torch.randn(s, 8, device=device), torch.bfloat16)
    reference = block.forward(x.clone(), t_emb, segments, rope, transformer_options={})
    for config in (ChunkingConfig(ffn_chunk=3000, qkv_chunk=2100, head_group=3),
                   ChunkingConfig(ffn_chunk=1000)):
        out = ChunkedBlockForward(block, config)(x.clone(), t_emb, segments, rope,
                                                 transformer_options={})
        assert torch.equal(out, reference)
    for hook in hooks:
        hook.eject()
