"""The pack's stand-in for ComfyUI's MiniMax H3 DiT, for tests and benchmarks without weights.

Same module paths, parameter names and forward as upstream's `comfy/ldm/minimax/model.py`
(checked bit for bit by `tests/test_twin_fidelity.py` where ComfyUI is available), random weights.
"""

from .attention import (
    AttentionTensorContainer,
    ComfyAttention,
    attention_config_tensor,
    attention_pytorch,
    optimized_attention,
)
from .config import TwinConfig
from .dit import MiniMaxH3Twin, PackedInputs
from .factory import (
    comfyui_attention,
    make_conditioning,
    make_inputs,
    make_twin,
    mask_conditioning,
    select_checkpoint_attention,
)
from .layout import SequenceLayout
from .patcher import TwinPatcher

__all__ = [
    "AttentionTensorContainer",
    "ComfyAttention",
    "MiniMaxH3Twin",
    "PackedInputs",
    "SequenceLayout",
    "TwinConfig",
    "TwinPatcher",
    "attention_config_tensor",
    "attention_pytorch",
    "comfyui_attention",
    "make_conditioning",
    "make_inputs",
    "make_twin",
    "mask_conditioning",
    "optimized_attention",
    "select_checkpoint_attention",
]
