"""The twin's attention dispatch: the same calling convention as ComfyUI's `optimized_attention`.

ComfyUI (newest Comfy-Org copy) calls, from the H3 attention module,

    optimized_attention(q, k, v, heads, preferred_attention=..., mask=None, skip_reshape=True,
                        transformer_options=...)

with q, k, v wrapped in `AttentionTensorContainer`s around strided `[1, H, S, D]` views of the
qkv buffer. Its `wrap_attn` decorator then calls, when one is installed,

    transformer_options["optimized_attention_override"](func, q, k, v, heads, mask=None,
        skip_reshape=True, transformer_options=..., _inside_attn_wrapper=True)

with the containers unwrapped (unless the override exposes `container_function`), where `func`
is the attention ComfyUI would have used. This module reproduces that behaviour so every feature
is tested against the exact convention it meets in ComfyUI. Written from the documented
behaviour; no ComfyUI code is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class AttentionTensorContainer:
    """Single-owner tensor handed to an attention backend (newest ComfyUI's type, mirrored)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor

    def peek(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self) -> torch.Tensor:
        tensor = self.peek()
        self.tensor = None
        return tensor


def unwrap_container(value: Any) -> Any:
    """A container's tensor (taking it), or the value itself: accepts both ComfyUI eras."""
    take = getattr(value, "take", None)
    if callable(take) and type(value).__name__ == "AttentionTensorContainer":
        return take()
    return value


def attention_pytorch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    mask: torch.Tensor | None = None,
    attn_precision: Any = None,
    skip_reshape: bool = False,
    skip_output_reshape: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """PyTorch SDPA with ComfyUI's layout rules.

    skip_reshape=True: q, k, v are `[B, H, S, D]`; otherwise `[B, S, H*D]`.
    Returns `[B, S, H*D]` (or `[B, H, S, D]` with skip_output_reshape).
    """
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, inner = q.shape
        dim_head = inner // heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def wrap_attn(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Route a call through `transformer_options["optimized_attention_override"]` when set."""

    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        preferred_attention = kwargs.pop("preferred_attention", None)
        containers = None
        if len(args) >= 3 and isinstance(args[0], AttentionTensorContainer):
            containers = args[:3]
        outermost = "_inside_attn_wrapper" not in kwargs
        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if containers is not None:
                        container_function = getattr(override, "container_function", None)
                        if container_function is not None:
                            return container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
                function = getattr(preferred_attention, "function", None)
                if function is not None:
                    return function(*args, **kwargs)
            if containers is not None:
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if outermost:
                kwargs.pop("_inside_attn_wrapper", None)

    wrapper.__wrapped__ = func  # type: ignore[attr-defined]
    return wrapper


optimized_attention = wrap_attn(attention_pytorch)


class ComfyAttention(torch.nn.Module):
    """Per-module preferred attention slot (newest ComfyUI); holds no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.config = None
        self.function: Callable[..., torch.Tensor] | None = None
