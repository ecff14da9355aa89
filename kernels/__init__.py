"""Attention kernels behind one registry (see `registry.py` and `backends.py`)."""

from .constraints import AttentionCall, Constraints, ShapeRule
from .registry import (
    AttentionBackend,
    BackendStatus,
    attention,
    backend_names,
    get_backend,
    list_backends,
    mark_unavailable,
    register,
    use_backend,
)


def backend_refusal(name: str) -> str | None:
    """Why `name` must not run in this process, before any model is patched with it (None:
    it may). triton_sage is refused under ComfyUI's DynamicVRAM (see its module)."""
    if name == "triton_sage":
        from .triton_sage import dynamic_vram_refusal

        return dynamic_vram_refusal()
    return None


__all__ = [
    "AttentionBackend",
    "AttentionCall",
    "BackendStatus",
    "Constraints",
    "ShapeRule",
    "attention",
    "backend_names",
    "backend_refusal",
    "get_backend",
    "list_backends",
    "mark_unavailable",
    "register",
    "use_backend",
]
