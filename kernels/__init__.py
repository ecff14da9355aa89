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

__all__ = [
    "AttentionBackend",
    "AttentionCall",
    "BackendStatus",
    "Constraints",
    "ShapeRule",
    "attention",
    "backend_names",
    "get_backend",
    "list_backends",
    "mark_unavailable",
    "register",
    "use_backend",
]
