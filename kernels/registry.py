"""Attention backend registry: register, mark unavailable (with the reason), pick, call.

Every backend computes softmax(q k^T * scale) v over `[B, H, S, D]` inputs (strided views
allowed) and returns `[B, H, S, D]`. Backends register themselves on first use
(`kernels.backends`); one whose import or device check fails is recorded with the reason, so a
diagnostics node can show `list_backends()`.

Legend: B batch, H heads, S sequence, D head dim.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from .constraints import AttentionCall, Constraints

AttentionFn = Callable[..., torch.Tensor]  # fn(q_BHSD, k_BHSD, v_BHSD, *, scale) -> out_BHSD


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: AttentionFn
    constraints: Constraints
    description: str
    deterministic: bool  # same inputs -> same bits (lets tests demand bit-identity)
    quantizing: bool = False  # INT8/FP8 inside: compare against an fp32 reference, not bits
    device_check: Callable[[torch.device], tuple[bool, str]] | None = None

    def violations(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor,
                   v_BHSD: torch.Tensor) -> list[str]:
        """Readable reasons this backend cannot run these inputs (empty: it can)."""
        call = AttentionCall.of(q_BHSD, k_BHSD, v_BHSD)
        found = self.constraints.violations(call)
        if not found and self.device_check is not None:
            ok, reason = self.device_check(call.device)
            if not ok:
                found.append(reason)
        return found


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str  # the description when available, why not otherwise


_lock = threading.Lock()
_backends: dict[str, AttentionBackend] = {}
_unavailable: dict[str, str] = {}
_registered = False
_default_stack: list[str] = ["sdpa"]


def register(backend: AttentionBackend) -> None:
    with _lock:
        _backends[backend.name] = backend
        _unavailable.pop(backend.name, None)


def mark_unavailable(name: str, reason: str) -> None:
    """Record that backend `name` cannot be used in this process, and why."""
    with _lock:
        _backends.pop(name, None)
        _unavailable[name] = reason


def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from . import backends

    backends.register_all()


def list_backends() -> list[BackendStatus]:
    """Every known backend, available or not, with its description or the reason it is not."""
    _ensure_registered()
    rows = [BackendStatus(n, True, b.description) for n, b in _backends.items()]
    rows += [BackendStatus(n, False, r) for n, r in _unavailable.items()]
    return sorted(rows, key=lambda r: r.name)


def backend_names() -> list[str]:
    """Names of every backend this registry knows about (available or not)."""
    return [row.name for row in list_backends()]


def get_backend(name: str | None = None) -> AttentionBackend:
    """The backend called `name` (default: the innermost `use_backend`, else "sdpa")."""
    _ensure_registered()
    name = _default_stack[-1] if name is None else name
    if name in _backends:
        return _backends[name]
    if name in _unavailable:
        raise ValueError(f"attention backend {name!r} is unavailable here: {_unavailable[name]};"
                         f" use one of {sorted(_backends)}")
    raise ValueError(f"unknown attention backend {name!r}; use one of {sorted(_backends)}")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[AttentionBackend]:
    """Make `name` the default backend of `attention()` inside the block (tests, A/B runs)."""
    backend = get_backend(name)
    _default_stack.append(name)
    try:
        yield backend
    finally:
        _default_stack.pop()


def attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
              backend: str | None = None, scale: float | None = None,
              output: Literal["BHSD", "BSF"] = "BHSD") -> torch.Tensor:
    """Attention over `[B, H, S, D]` q, k, v (strided views allowed).

    Returns `[B, H, S, D]` (output="BHSD") or `[B, S, H*D]` (output="BSF", ComfyUI's layout).
    Raises ValueError listing what the chosen backend does not support.
    """
    chosen = get_backend(backend)
    problems = chosen.violations(q_BHSD, k_BHSD, v_BHSD)
    if problems:
        raise ValueError(f"attention backend {chosen.name!r} cannot run this call: "
                         f"{'; '.join(problems)}; choose another backend (e.g. 'sdpa')")
    return run_checked(chosen, q_BHSD, k_BHSD, v_BHSD, scale=scale, output=output)


def run_checked(chosen: AttentionBackend, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor,
                v_BHSD: torch.Tensor, *, scale: float | None = None,
                output: Literal["BHSD", "BSF"] = "BHSD") -> torch.Tensor:
    """`attention` for a call whose `chosen.violations` the caller found empty (no second
    check on the per-call path)."""
    out_BHSD = chosen.fn(q_BHSD, k_BHSD, v_BHSD, scale=scale)
    if output == "BHSD":
        return out_BHSD
    b, h, s, d = out_BHSD.shape
    return out_BHSD.transpose(1, 2).reshape(b, s, h * d)
