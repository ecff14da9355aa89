"""What an attention backend supports, as data: dtypes, devices, compute capability, shapes.

A backend declares a frozen `Constraints`; `Constraints.violations(call)` lists, in words, every
rule a concrete call breaks (empty list: the backend may run it). Nothing here imports a kernel.

Legend: B batch, H heads, S sequence, D head dim; a "row stride" is the element distance between
two consecutive sequence rows of one head (21,504 for H3's strided views of the qkv buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionCall:
    """The facts about one attention call that constraints look at (no tensors kept)."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_row_stride: int  # largest sequence-dim stride of q, k, v in elements

    @classmethod
    def of(cls, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor
           ) -> AttentionCall:
        b, h, s_q, d = q_BHSD.shape
        return cls(batch=b, heads=h, seq_q=s_q, seq_k=k_BHSD.shape[2], head_dim=d,
                   dtype=q_BHSD.dtype, device=q_BHSD.device,
                   max_row_stride=max(t.stride(2) for t in (q_BHSD, k_BHSD, v_BHSD)))


@dataclass(frozen=True)
class ShapeRule:
    """One shape limit: `check(call)` is True when the call is allowed; `description` says why."""

    description: str
    check: Callable[[AttentionCall], bool]


@dataclass(frozen=True)
class Constraints:
    dtypes: frozenset[torch.dtype]
    device_types: frozenset[str]  # "cuda" covers ROCm too (torch.cuda is HIP there)
    min_compute_capability: tuple[int, int] | None = None  # CUDA only; ignored on ROCm
    shape_rules: tuple[ShapeRule, ...] = field(default_factory=tuple)

    def violations(self, call: AttentionCall) -> list[str]:
        """Every rule `call` breaks, as readable sentences."""
        found: list[str] = []
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in self.dtypes))
            found.append(f"dtype {str(call.dtype).replace('torch.', '')} not in {{{names}}}")
        if call.device.type not in self.device_types:
            found.append(f"device {call.device} not in {sorted(self.device_types)}")
        elif self.min_compute_capability is not None and call.device.type == "cuda" \
                and torch.version.hip is None:
            cc = torch.cuda.get_device_capability(call.device)
            if cc < self.min_compute_capability:
                found.append(f"compute capability {cc[0]}.{cc[1]} below "
                             f"{self.min_compute_capability[0]}.{self.min_compute_capability[1]}")
        for rule in self.shape_rules:
            if not rule.check(call):
                found.append(rule.description)
        return found


FLOAT16_TYPES = frozenset({torch.float16, torch.bfloat16})
ALL_FLOAT_TYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
