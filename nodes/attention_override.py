"""An attention override that runs one `kernels` backend, in ComfyUI's calling convention.

ComfyUI calls `override(func, q, k, v, heads, mask=None, skip_reshape=..., transformer_options=...,
**kw)`, `func` being the attention it would have used (see `kernels.comfy_calling` for layouts).

Composition with Dual-Sage, in either order, shards this node's kernel:
- installed after Dual-Sage: Dual-Sage is our `previous` and receives our kernel as its `func`;
- installed before it: Dual-Sage calls us with a sharding function as `func`, and we hand it our
  kernel through `func.with_function(kernel)`.
Calls our backend cannot serve (a mask, shapes it refuses) go to ComfyUI's own function.
The node installs through the seam with a `BackendChoice` as its state: Dual-Sage, applied
after it, asks the seam (`protocol.link_info`) which backend the override it wraps runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..comfy_seam import protocol
from ..comfy_seam.names import OVERRIDE_KEY  # noqa: F401  (the tests read it from here)
from ..kernels.comfy_calling import backend_function


@dataclass(eq=False)
class BackendChoice:
    """The node's state: the `kernels` backend its override runs."""

    backend: str


def make_backend_attention(backend: str) -> Callable[..., Any]:
    """A function with optimized_attention's signature that runs `backend` from `kernels`."""
    return backend_function(backend)


def make_override(backend: str, previous: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The override to install; `previous` is an override that was already there (or None)."""
    chosen = backend_function(backend).backend  # ValueError now, naming the available backends

    def override(func, q, k, v, heads, *args, **kwargs):
        with_function = getattr(func, "with_function", None)
        if with_function is not None:
            # a sharding function (Dual-Sage installed after us): shard our kernel, and send
            # the calls our kernel cannot take to the function it shards, unsharded
            ours = backend_function(chosen.name, fallback=func.function)
            return with_function(ours)(q, k, v, heads, *args, **kwargs)
        ours = backend_function(chosen.name, fallback=func)
        if previous is not None:
            return previous(ours, q, k, v, heads, *args, **kwargs)
        return ours(q, k, v, heads, *args, **kwargs)

    return override


def apply_backend_override(model: Any, backend: str) -> Any:
    """Clone `model` (a ModelPatcher) with `backend` as its attention; status recorded."""
    from ..kernels import backend_refusal

    refusal = backend_refusal(backend)
    if refusal is not None:  # named on the node before the model is cloned or patched
        raise ValueError(f"backend={backend!r}: {refusal}")
    chosen = BackendChoice(backend_function(backend).backend.name)
    patched = model.clone()
    previous = protocol.override_of(patched)
    protocol.install(patched, "attention",
                     protocol.override(lambda prev: make_override(backend, prev)), state=chosen)
    info = protocol.link_info(previous)
    if info is not None and info.feature == "dual_sage":
        # the node composes the two: Dual-Sage's line now names this node's kernel as sharded
        from ..dual_sage.apply import sage_node_words, status_text

        how = " (sharded by the Dual-Sage installed before)"
        protocol.record_status(patched, "dual_sage", status_text(
            info.state, function=sage_node_words(backend)))
    elif previous is not None:
        how = " (chained under the override already installed)"
    else:
        how = ""
    protocol.record_status(patched, "attention", f"backend {backend}{how}")
    return patched
