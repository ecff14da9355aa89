"""On-activation LoRA for the twin, attached the way ComfyUI attaches bypass adapters.

ComfyUI's bypass mode (`comfy/weight_adapter/bypass.py`) leaves the weight alone and replaces
the Linear instance's `forward` with a bound method of a hook that holds `adapter` and
`original_forward`; the hook computes `g(f(x) + h(x))`, or calls the adapter's own
`bypass_forward`. Its LoRA adapter computes `h(x) = up(down(x)) * scale` (scale = alpha / rank *
strength) and adds the base output into h's buffer in place. So each adapted linear makes one
more output-sized tensor per call: the +4.18 GiB of the 15 s PASS2 out-of-memory on qkv_proj.

This module reproduces that mechanism (own code, same attribute names), so tests and benchmarks
exercise the exact call path the chunked block meets in ComfyUI: `module(x)` runs the adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class ActivationLoRA:
    """LoRA applied on activations: weights = (up [out, r], down [r, in], alpha, None, ...)."""

    def __init__(self, up_OR: torch.Tensor, down_RI: torch.Tensor, alpha: float | None = None,
                 multiplier: float = 1.0):
        self.weights = (up_OR, down_RI, alpha, None, None, None)
        self.multiplier = multiplier
        self._cast: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def scale(self) -> float:
        up, down, alpha = self.weights[:3]
        base = 1.0 if alpha is None else alpha / down.shape[0]
        return base * self.multiplier

    def h(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        """up(down(x)) * scale, [rows, out]; the down output [rows, r] is transient."""
        up, down = self._weights_like(x)
        out = F.linear(F.linear(x, down), up)
        return out.mul_(self.scale)

    def _weights_like(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(up, down) on x's device and dtype, cast once per device/dtype.

        The adapter is attached where the linear's weight is when it is made (ComfyUI builds
        models on the offload device), and the model moves to its load device (cuda:1 next to
        the helper's cuda:0) afterwards: the activations' device is the one to compute on.
        """
        up, down = self.weights[0], self.weights[1]
        cast = self._cast
        if cast is None or cast[0].device != x.device or cast[0].dtype != x.dtype:
            cast = (up.to(device=x.device, dtype=x.dtype), down.to(device=x.device, dtype=x.dtype))
            self._cast = cast
        return cast

    def g(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def bypass_forward(self, org_forward: Callable[..., torch.Tensor], x: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
        base = org_forward(x, *args, **kwargs)
        out = self.h(x, base)
        torch.add(base, out, out=out)  # reuse h's buffer: one extra output-sized tensor, not two
        del base
        return self.g(out)


class ActivationAdapterHook:
    """Wraps `module.forward` with an adapter (inject/eject), like ComfyUI's bypass hook."""

    def __init__(self, module: torch.nn.Module, adapter: ActivationLoRA):
        self.module = module
        self.adapter = adapter
        self.original_forward: Callable[..., torch.Tensor] | None = None
        self._restore_instance_forward = False

    def bypass_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.original_forward is not None, "hook is not injected"
        return self.adapter.bypass_forward(self.original_forward, x, *args, **kwargs)

    def inject(self) -> ActivationAdapterHook:
        if self.original_forward is None:
            self._restore_instance_forward = "forward" in self.module.__dict__
            self.original_forward = self.module.forward
            self.module.forward = self.bypass_forward
        return self

    def eject(self) -> None:
        if self.original_forward is not None:
            if self._restore_instance_forward:
                self.module.forward = self.original_forward
            else:
                del self.module.forward  # back to the class's forward
            self.original_forward = None


def attach_activation_lora(linear: torch.nn.Linear, rank: int, *, alpha: float | None = None,
                           multiplier: float = 1.0, seed: int = 0,
                           std: float = 0.02) -> ActivationAdapterHook:
    """Give `linear` a random rank-`rank` on-activation LoRA and inject it; returns the hook.

    up [out, r] and down [r, in] are drawn on the CPU from `seed` (device-independent values),
    stored in the linear's dtype and device. alpha defaults to rank (scale = multiplier).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = linear.weight
    up = torch.randn(weight.shape[0], rank, generator=gen) * std
    down = torch.randn(rank, weight.shape[1], generator=gen) * (weight.shape[1] ** -0.5)
    adapter = ActivationLoRA(up.to(weight.device, weight.dtype),
                             down.to(weight.device, weight.dtype),
                             alpha=float(rank) if alpha is None else alpha, multiplier=multiplier)
    return ActivationAdapterHook(linear, adapter).inject()
