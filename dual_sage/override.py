"""The override Dual-Sage installs, and the function it hands on: what runs the shard per call.

`DualSageOverride` is ComfyUI's `optimized_attention_override(func, q, k, v, heads, **kwargs)`;
it builds a `ShardingFunction` (an attention function in ComfyUI's convention that shards the
function ComfyUI would have run, `function_for`) and calls the override installed before it
with that function, or the function itself. See `apply` for the chaining in both orders.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comfy_seam import names, protocol
from ..comfy_seam.attention import running_attention_module
from ..comfy_seam.h3 import preferred_function
from ..exchange.mode import heads_allowed
from ..kernels.comfy_calling import backend_function
from .sharded import Attend, ShardedAttention, warn_once

COMFYUI_FUNCTION = "comfyui"  # backend value: shard whatever ComfyUI would run (the default)


def _unwrap(value: Any) -> Any:
    """A container's tensor (newest ComfyUI's AttentionTensorContainer), or the value itself."""
    if type(value).__name__ == "AttentionTensorContainer" and callable(getattr(value, "take",
                                                                               None)):
        return value.take()
    return value


def per_heads(function: Any, kwargs: dict[str, Any]) -> Attend:
    """`attend(q, k, v)` for a head subset: `function` with the call's own keywords."""

    def attend(q_BhSD: torch.Tensor, k_BhSD: torch.Tensor, v_BhSD: torch.Tensor
               ) -> torch.Tensor:
        b, h, s, d = q_BhSD.shape
        out = function(q_BhSD, k_BhSD, v_BhSD, h, **kwargs)
        if out.dim() == 4:  # skip_output_reshape: [B, h, S, D]
            return out
        return out.reshape(b, s, h, d).transpose(1, 2)

    return attend


class ShardingFunction:
    """An attention function in ComfyUI's convention that shards `function` over the GPUs.

    `with_function(other)` shards another function instead: the hook an override chained
    under Dual-Sage uses to have its own kernel sharded.
    """

    def __init__(self, sharded: ShardedAttention, function: Any):
        self.sharded = sharded
        self.function = function

    def with_function(self, function: Any) -> ShardingFunction:
        return ShardingFunction(self.sharded, function)

    def __call__(self, q: Any, k: Any, v: Any, heads: int, *args: Any, **kwargs: Any) -> Any:
        """Shard when the call is H3's `[1, H, S, D]` unmasked attention, else `function`."""
        q, k, v = _unwrap(q), _unwrap(k), _unwrap(v)
        if not heads_allowed(kwargs.get(names.TRANSFORMER_OPTIONS)):
            # this step runs sequence-parallel (the call is already one GPU's head share) or on
            # one GPU: the function ComfyUI would run, unsharded
            return self.function(q, k, v, heads, *args, **kwargs)
        shardable = (not args and kwargs.get("mask") is None and kwargs.get("skip_reshape")
                     and q.dim() == 4 and q.shape[1] == heads and q.shape == k.shape == v.shape)
        if not shardable:
            return self.function(q, k, v, heads, *args, **kwargs)
        out_BSF = self.sharded(q, k, v, per_heads(self.function, kwargs))
        if kwargs.get("skip_output_reshape"):
            b, h, s, d = q.shape
            return out_BSF.view(b, s, h, d).transpose(1, 2)
        return out_BSF


class DualSageOverride:
    """`optimized_attention_override(func, q, k, v, heads, **kwargs)` running the shard."""

    def __init__(self, sharded: ShardedAttention, previous: Any = None,
                 backend: str = COMFYUI_FUNCTION, diffusion_model: Any = None):
        self.sharded = sharded
        self.previous = previous
        self.explicit_backend = backend
        self.diffusion_model = diffusion_model

    def __deepcopy__(self, memo) -> DualSageOverride:
        # ComfyUI deep-copies model_options on clone: every clone shares this runtime (its
        # streams and workspaces), as it shares the model
        return self

    def __call__(self, func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any,
                 **kwargs: Any) -> Any:
        options = kwargs.get(names.TRANSFORMER_OPTIONS)
        outermost = isinstance(options, dict) and protocol.override_of(options) is self
        sharding = ShardingFunction(self.sharded, self.function_for(func, outermost))
        if self.previous is not None:
            return self.previous(sharding, q, k, v, heads, *args, **kwargs)
        return sharding(q, k, v, heads, *args, **kwargs)

    def function_for(self, func: Any, outermost: bool) -> Any:
        """What ComfyUI would run for this call if Dual-Sage were not installed.

        Called by a later override: `func`, that override's choice (as the SageAttention
        node's kernel). Called by ComfyUI itself: an explicitly chosen backend (masked and
        unsupported calls still go to `func`); else, with an earlier override chained, `func`
        (overrides win over preferred attention in ComfyUI, and that override still picks
        through `with_function`); else the running module's preferred attention when set,
        else `func`.
        """
        if not outermost:
            return func
        if self.explicit_backend != COMFYUI_FUNCTION:
            return backend_function(self.explicit_backend, fallback=func)
        if self.previous is None:
            preferred = self._preferred_function()
            if preferred is not None:
                return preferred
        return func

    def _preferred_function(self) -> Any:
        module = running_attention_module()
        if module is not None:
            return preferred_function(module)
        # a call outside the DiT blocks (none reach the override in ComfyUI today: the token
        # refiner runs in extra_conds): the model's preferred attention when every module agrees
        functions = {id(getattr(m.comfy_attention, "function", None)): m.comfy_attention.function
                     for m in attention_modules(self.diffusion_model)}
        if len(functions) > 1:
            warn_once("dual_sage", "Dual-Sage: an attention call outside the DiT blocks, and the "
                                   "model's modules prefer different attention functions; using "
                                   "ComfyUI's default function for it")
            return None
        return next(iter(functions.values()), None)


def attention_modules(diffusion_model: Any) -> list[Any]:
    if diffusion_model is None:
        return []
    return [m for m in diffusion_model.modules() if hasattr(m, "comfy_attention")]
