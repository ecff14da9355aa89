"""Test-only ComfyUI custom node: MiniMax H3's text encoder at a tiny width.

ComfyUI cannot load a small Qwen3-VL for H3: `comfy.sd` detects the MiniMax H3 encoder by its
tensor names (`visual.deepstack_merger_list.0.norm.weight` and `model.layers.49...`) and then
builds `comfy.text_encoders.qwen3vl.Qwen3VL` with the fixed `Qwen3VL_32BConfig` (hidden 5120,
50 layers, 64 heads; vision tower 1152 wide, 27 blocks): no size is read from the file
(comfy/sd.py, comfy/text_encoders/minimax.py, llama.py, qwen3vl.py of ComfyUI 0.33.0). The
real encoder is a 14.6 GB NVFP4 file (26 B parameters), far past a CPU test.

Loaded into the test server's custom_nodes, this module swaps those two configurations for tiny
ones (still 50 layers, so the detection still takes the file for H3's): the bundled workflows
then run unchanged, CLIPLoader, tokenizer, vision tower and ComfyUI's own H3 encoder code
included, on a file `tests/e2e_models.py` writes at the same sizes. It registers no node.
"""

from dataclasses import dataclass

# The DiT's text_dim in tests/h3_checkpoints.DiTShape.tiny() is this hidden size.
TEXT_HIDDEN = 64
VISION = dict(hidden_size=64, intermediate_size=128, depth=3, num_heads=2,
              deepstack_visual_indexes=[0, 1, 2])

NODE_CLASS_MAPPINGS = {}  # no annotations anywhere: dataclass() reads them eagerly


def apply() -> None:
    """Make ComfyUI build H3's text encoder (model type qwen3vl_32b) at the tiny sizes."""
    # ComfyUI internals (0.33.0): the config table and vision sizes Qwen3VL reads by type.
    import comfy.text_encoders.qwen3vl as qwen3vl

    base = qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"]
    if getattr(base, "h3_tiny", False):
        return

    @dataclass
    class TinyQwen3VL32BConfig(base):
        hidden_size: int = TEXT_HIDDEN
        intermediate_size: int = 128
        num_attention_heads: int = 2
        num_key_value_heads: int = 1

    TinyQwen3VL32BConfig.h3_tiny = True
    qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"] = TinyQwen3VL32BConfig
    qwen3vl.QWEN3VL_VISION["qwen3vl_32b"] = dict(VISION)


try:  # inside ComfyUI; importing this file elsewhere (the checkpoint writer) is fine too
    import comfy.text_encoders.qwen3vl  # noqa: F401
except ImportError:
    pass
else:
    apply()
