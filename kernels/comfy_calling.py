"""A `kernels` backend in ComfyUI's attention calling convention.

ComfyUI calls attention functions as `fn(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)`: with skip_reshape q, k, v are
`[B, H, S, D]` (H3 passes strided views of its qkv buffer), otherwise `[B, S, H*D]`; the result
is `[B, S, H*D]` unless `skip_output_reshape` asks for `[B, H, S, D]`. Calls the backend cannot
serve (a mask, shapes its constraints refuse) go to the `fallback` function unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .registry import attention, get_backend, run_checked


def to_bhsd(t: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:
        return t
    b, s, inner = t.shape
    return t.view(b, s, heads, inner // heads).transpose(1, 2)


def backend_function(backend: str, fallback: Callable[..., Any] | None = None
                     ) -> Callable[..., Any]:
    """`backend` of the registry with ComfyUI's attention signature (ValueError if unknown).

    `fallback` (ComfyUI's own function) takes the calls the backend cannot serve; without one
    such a call raises the backend's ValueError.
    """
    chosen = get_backend(backend)  # ValueError now, naming the available backends

    def backend_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
        q4, k4, v4 = (to_bhsd(t, heads, skip_reshape) for t in (q, k, v))
        problems = chosen.violations(q4, k4, v4)
        if fallback is not None and (mask is not None or problems):
            return fallback(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                            skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                            **kwargs)
        if mask is not None:
            raise ValueError(f"attention backend {chosen.name!r} takes no mask; give it a "
                             "fallback function for masked calls")
        output = "BHSD" if skip_output_reshape else "BSF"
        if problems:  # no fallback: the registry's error names what this backend cannot do
            return attention(q4, k4, v4, backend=chosen.name, scale=kwargs.get("scale"),
                             output=output)
        return run_checked(chosen, q4, k4, v4, scale=kwargs.get("scale"), output=output)

    backend_attention.backend = chosen
    return backend_attention
