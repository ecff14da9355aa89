"""Which H3 attention module is running, for overrides that must run what ComfyUI would run.

ComfyUI internal: the newest files pass each H3 `Attention`'s `comfy_attention` to
`optimized_attention` as `preferred_attention=`, and `wrap_attn` pops that keyword before it
calls an override (0.33.0 has no preferred attention). An override that means to run the
module's preferred function (Dual-Sage) therefore learns the module from a `("double_block", i)`
replace patch, `RecordAttentionModule`, which sets a ContextVar while the block runs.
ContextVars are not inherited by threads: a call made on another thread sees None.
"""

from __future__ import annotations

import contextvars
from typing import Any

from . import protocol

_running_attention: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "h3_multigpu_running_attention", default=None)


def running_attention_module() -> Any:
    """The attention module of the DiT block running now on this thread, or None."""
    return _running_attention.get()


class RecordAttentionModule:
    """`("double_block", i)` replace patch: records block i's attention module while it runs.

    Chains the patch that was there (offload's, a user's) or calls the original block. A patch
    that passes its own `attention` module in `args` is honoured (upstream's DiTBlock takes one).
    Installed by `recorder_patches`.
    """

    def __init__(self, attention_module: Any, previous: Any = None):
        self.attention_module = attention_module
        self.previous = previous

    def __deepcopy__(self, memo) -> RecordAttentionModule:
        return self  # holds the model's own module: never copied with model_options

    def __call__(self, args: dict, extra: dict) -> dict:
        passed = args.get("attention")
        module = passed if hasattr(passed, "comfy_attention") else self.attention_module
        token = _running_attention.set(module)
        try:
            if self.previous is not None:
                return self.previous(args, extra)
            return extra["original_block"](args)
        finally:
            _running_attention.reset(token)


def recorder_patches(diffusion_model: Any) -> list[protocol.Hook]:
    """One `RecordAttentionModule` block patch per DiT block, chaining the one there. Marked
    transparent: it never reads the residual stream, so the sequence mode keeps its rows split
    across it."""
    hooks = []
    for i, block in enumerate(getattr(diffusion_model, "blocks", None) or []):
        attention = getattr(block, "attn", None)
        if attention is not None:
            hooks.append(protocol.block_patch(
                i, lambda previous, attention=attention: RecordAttentionModule(attention,
                                                                               previous),
                transparent=True))
    return hooks
