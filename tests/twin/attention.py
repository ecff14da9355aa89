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

import json
import logging
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
    """ComfyUI's dispatch around an attention function, in the order ComfyUI applies it.

    Outermost call only: an installed `optimized_attention_override` wins (it gets the
    containers when it exposes `container_function`, else the taken tensors and `func`); then
    the module's `preferred_attention.function` (a checkpoint's `comfy_attention.config`);
    then `func` itself (its own `container_function` when it has one).
    """

    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        preferred = kwargs.pop("preferred_attention", None)
        containers = None
        if len(args) >= 3 and isinstance(args[0], AttentionTensorContainer):
            if not all(isinstance(a, AttentionTensorContainer) for a in args[1:3]):
                raise TypeError("q, k and v must all be attention tensor containers")
            containers = args[:3]
        outermost = "_inside_attn_wrapper" not in kwargs
        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if containers is not None:
                        if hasattr(override, "container_function"):
                            return override.container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
                function = getattr(preferred, "function", None)
                if function is not None:
                    return function(*args, **kwargs)
            if containers is not None:
                if wrapper.container_function is not None:
                    return wrapper.container_function(*args, **kwargs)
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if outermost:
                kwargs.pop("_inside_attn_wrapper", None)

    wrapper.__wrapped__ = func  # type: ignore[attr-defined]
    wrapper.container_function = None  # type: ignore[attr-defined]
    return wrapper


optimized_attention = wrap_attn(attention_pytorch)


def attention_kitchen_int8(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                           heads: int, mask: torch.Tensor | None = None,
                           skip_reshape: bool = False, skip_output_reshape: bool = False,
                           **kwargs: Any) -> torch.Tensor:
    """comfy-kitchen's INT8 attention, for checkpoints whose `comfy_attention.config` asks for it.

    Takes `[B, H, S, D]` (skip_reshape=True, what H3 passes) and returns `[B, S, H*D]`.
    """
    if not skip_reshape:
        raise ValueError("the twin's INT8 attention takes [B, H, S, D] inputs (skip_reshape)")
    import comfy_kitchen

    out = comfy_kitchen.int8_attention(q_BHSD, k_BHSD, v_BHSD, scale=kwargs.get("scale"),
                                       attn_mask=mask)
    if skip_output_reshape:
        return out
    b, _, _, dim_head = q_BHSD.shape
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def _kitchen_int8_for(device: torch.device | None) -> Callable[..., torch.Tensor] | None:
    try:
        import comfy_kitchen
    except ImportError:
        return None
    if not comfy_kitchen.int8_attention_is_available(device):
        return None
    return wrap_attn(attention_kitchen_int8)


# `comfy_attention.config` methods the twin knows: method -> (device -> function or None)
PREFERRED_ATTENTION: dict[str, Callable[[torch.device | None], Any]] = {
    "comfy_kitchen_int8": _kitchen_int8_for,
}


class ComfyAttention(torch.nn.Module):
    """Per-module preferred attention slot (newest ComfyUI), configured by the checkpoint.

    A checkpoint may carry `<prefix>comfy_attention.config`: a uint8 tensor holding JSON such as
    `{"attention": "comfy_kitchen_int8"}`. Loading it sets `config` and, when that method runs
    on `device` (the twin's stand-in for ComfyUI's torch device), `function`, which the
    attention dispatch then calls instead of the default. Saving writes the config back.
    """

    device: torch.device | None = None  # where `function` must run; None: the default device

    def __init__(self) -> None:
        super().__init__()
        self.config: dict | None = None
        self.function: Callable[..., torch.Tensor] | None = None

    def select(self, method: str | None, device: torch.device | None = None) -> None:
        """What loading a checkpoint whose config names `method` does (None: the default)."""
        self.config, self.function = None, None
        if method is not None:
            if method not in PREFERRED_ATTENTION:
                raise ValueError(f"unknown checkpoint attention {method!r}; the twin knows "
                                 f"{sorted(PREFERRED_ATTENTION)} (or None for the default)")
            self.config = {"attention": method}
            self.function = PREFERRED_ATTENTION[method](device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self.config = None
        self.function = None
        raw = state_dict.pop(prefix + "config", None)
        if raw is not None:
            config = json.loads(raw.numpy().tobytes())
            resolve = PREFERRED_ATTENTION.get(config.get("attention"))
            if resolve is None:
                logging.warning("ignoring unsupported attention method %r for %s",
                                config.get("attention"), prefix.rstrip("."))
            else:
                self.config = config
                self.function = resolve(self.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.config is not None:
            encoded = json.dumps(self.config).encode("utf-8")
            destination[prefix + "config"] = torch.tensor(list(encoded), dtype=torch.uint8)


def attention_config_tensor(method: str) -> torch.Tensor:
    """The `comfy_attention.config` state-dict entry selecting `method`."""
    return torch.tensor(list(json.dumps({"attention": method}).encode("utf-8")),
                        dtype=torch.uint8)
