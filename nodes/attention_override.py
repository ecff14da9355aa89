"""An attention override that runs one `kernels` backend, in ComfyUI's calling convention.

ComfyUI calls `override(func, q, k, v, heads, mask=None, skip_reshape=..., transformer_options=...,
**kw)`, `func` being the attention it would have used. With skip_reshape q, k, v are
`[B, H, S, D]` (H3 passes strided views of its qkv buffer), otherwise `[B, S, H*D]`; the result
is `[B, S, H*D]` unless `skip_output_reshape` asks for `[B, H, S, D]`.

Chaining: an override already installed (e.g. Dual-Sage) keeps control and receives our
backend as its `func`, so it shards heads and our kernel attends each shard. Calls our backend
cannot serve (a mask, or shapes it refuses) go to ComfyUI's own `func` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OVERRIDE_KEY = "optimized_attention_override"


def _to_bhsd(t, heads: int, skip_reshape: bool):
    if skip_reshape:
        return t
    b, s, inner = t.shape
    return t.view(b, s, heads, inner // heads).transpose(1, 2)


def make_backend_attention(backend: str) -> Callable[..., Any]:
    """A function with optimized_attention's signature that runs `backend` from `kernels`."""
    from ..kernels import attention, get_backend

    chosen = get_backend(backend)  # ValueError now, naming the available backends

    def backend_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
        out_layout = "BHSD" if skip_output_reshape else "BSF"
        return attention(_to_bhsd(q, heads, skip_reshape), _to_bhsd(k, heads, skip_reshape),
                         _to_bhsd(v, heads, skip_reshape), backend=chosen.name, output=out_layout)

    backend_attention.backend = chosen
    return backend_attention


def make_override(backend: str, previous: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The override to install; `previous` is an override that was already there (or None)."""
    backend_attention = make_backend_attention(backend)
    chosen = backend_attention.backend

    def override(func, q, k, v, heads, mask=None, skip_reshape=False, **kwargs):
        def ours(q_, k_, v_, heads_, mask=None, skip_reshape=False, **kw):
            if mask is not None:
                return func(q_, k_, v_, heads_, mask=mask, skip_reshape=skip_reshape, **kw)
            q4 = _to_bhsd(q_, heads_, skip_reshape)
            k4 = _to_bhsd(k_, heads_, skip_reshape)
            v4 = _to_bhsd(v_, heads_, skip_reshape)
            if chosen.violations(q4, k4, v4):
                return func(q_, k_, v_, heads_, mask=mask, skip_reshape=skip_reshape, **kw)
            return backend_attention(q4, k4, v4, heads_, skip_reshape=True, **kw)

        if previous is not None:
            return previous(ours, q, k, v, heads, mask=mask, skip_reshape=skip_reshape, **kwargs)
        return ours(q, k, v, heads, mask=mask, skip_reshape=skip_reshape, **kwargs)

    override.backend = chosen.name
    return override


def apply_backend_override(model: Any, backend: str) -> Any:
    """Clone `model` (a ModelPatcher) with `backend` as its attention; status recorded."""
    from .status import record

    patched = model.clone()
    to = patched.model_options.setdefault("transformer_options", {})
    previous = to.get(OVERRIDE_KEY)
    to = patched.model_options["transformer_options"] = dict(to)
    to[OVERRIDE_KEY] = make_override(backend, previous)
    chained = " (chained under the override already installed)" if previous else ""
    record(patched.model_options, "attention", f"backend {backend}{chained}")
    return patched
