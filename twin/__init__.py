"""Structural twin of ComfyUI's MiniMax H3 DiT, for tests and benchmarks without weights."""

from .attention import AttentionTensorContainer, attention_pytorch, optimized_attention
from .dit import MiniMaxH3Twin, PackedInputs, make_inputs, make_twin
from .model import TwinConfig
from .patcher import TwinPatcher

__all__ = [
    "AttentionTensorContainer",
    "MiniMaxH3Twin",
    "PackedInputs",
    "TwinConfig",
    "TwinPatcher",
    "attention_pytorch",
    "make_inputs",
    "make_twin",
    "optimized_attention",
]
