"""ComfyUI seam: `DualSageConfig` and `apply_dual_sage(model_patcher, config)`.

Installs, on a clone of the patcher, (1) an `optimized_attention_override` in
`transformer_options` that runs H3's attention calls through `ShardedAttention`, and (2) a
DIFFUSION_MODEL wrapper that makes the root GPU current while the DiT runs (ComfyUI's
`current_stream(device)` returns the *current* device's stream, so a DiT on cuda:1 needs cuda:1
current).

Chaining: an override already installed keeps priority. Ours calls it with our sharded function
as its `func`, so it still sees every call (logging, a different kernel for masked calls, ...)
and decides whether to call through to the shard. Calls the shard cannot take (a mask, the
`[B, S, H*D]` layout, unknown positional extras) go to ComfyUI's own `func` unchanged, with
every keyword passed on.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..exchange.mode import heads_allowed
from ..exchange.transport import TransportMode, resolve
from ..kernels import backend_names
from . import sizing
from .shard_plan import ShardPlan, parse_devices, parse_split, validate_devices
from .sharded import ShardedAttention

WRAPPER_KEY = "h3_multigpu_dual_sage"
DEFAULT_LINK_GBPS = {TransportMode.PEER: 300.0, TransportMode.HOST: 25.0}
DEFAULT_TFLOPS = 550.0  # bf16 attention of one current GPU; only the ratio between GPUs matters


@dataclass
class DualSageConfig:
    """Head-sharded attention over the root GPU and helper GPUs.

    helpers: helper devices ("cuda:0", ...) or None for every other visible GPU.
    split: "auto" (equal), head counts "28:28" (root first) or throughputs "1.0:0.7".
    backend: attention backend name of `kernels` ("sdpa", "ck_int8", ...).
    min_tokens: calls shorter than this stay on the root; None chooses from the link.
    transport: "auto" (peer when possible), "peer" or "host" (pinned host relay).
    """

    helpers: tuple[str, ...] | None = None
    split: str = "auto"
    backend: str = "sdpa"
    min_tokens: int | None = None
    transport: TransportMode | str = TransportMode.AUTO
    chunk_heads: int = sizing.DEFAULT_CHUNK_HEADS
    ring_slots: int = sizing.DEFAULT_RING_SLOTS
    heads: int = 56  # used when the model does not say

    def __post_init__(self) -> None:
        if isinstance(self.transport, str):
            try:
                self.transport = TransportMode(self.transport.strip().lower())
            except ValueError:
                raise ValueError(f"transport {self.transport!r} is unknown; use 'auto', 'peer' "
                                 "or 'host'") from None
        if self.backend not in backend_names():
            raise ValueError(f"attention backend {self.backend!r} is unknown; use one of "
                             f"{backend_names()}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0 (or 'auto')")
        if self.chunk_heads < 1 or self.ring_slots < 1:
            raise ValueError(f"chunk_heads={self.chunk_heads} and ring_slots={self.ring_slots} "
                             "must be at least 1")
        if self.helpers is not None:
            self.helpers = tuple(str(d) for d in self.helpers)

    @classmethod
    def from_strings(cls, helpers: str = "auto", split: str = "auto", backend: str = "sdpa",
                     min_tokens: str | int = "auto", transport: str = "auto") -> DualSageConfig:
        """What a node passes: helpers "auto"|"gpu:0,gpu:2", min_tokens "auto"|int."""
        devices = parse_devices(helpers)
        if isinstance(min_tokens, str):
            text = min_tokens.strip().lower()
            if text in ("auto", ""):
                tokens = None
            elif text.isdigit():
                tokens = int(text)
            else:
                raise ValueError(f"min_tokens {min_tokens!r} must be 'auto' or a whole number "
                                 "of tokens, e.g. 8192")
        else:
            tokens = int(min_tokens)
        # Parse the split now, for H3's heads and the named helpers (or as many devices as it
        # has entries), so a typo is refused when the node is validated, not when it runs.
        if not isinstance(split, str):
            raise ValueError(f"head split {split!r} must be text such as '28:28' or 'auto'")
        if split.strip().lower() not in ("auto", ""):
            entries = len(split.replace(",", ":").split(":"))
            parse_split(split, cls.heads, 1 + len(devices) if devices else max(2, entries))
        return cls(helpers=None if devices is None else tuple(str(d) for d in devices),
                   split=split, backend=backend.strip(), min_tokens=tokens, transport=transport)


def _model_heads(model_patcher: Any, default: int) -> int:
    """The DiT's attention head count (first block), or `default`."""
    with contextlib.suppress(AttributeError, IndexError, TypeError):
        heads = model_patcher.get_model_object("diffusion_model").blocks[0].attn.heads
        if isinstance(heads, int):
            return heads
    return default


def _root_device(model_patcher: Any) -> torch.device:
    root = torch.device(model_patcher.load_device)
    if root.type == "cuda" and root.index is None:
        root = torch.device("cuda", torch.cuda.current_device())
    return root


def build_sharded_attention(model_patcher: Any, config: DualSageConfig) -> ShardedAttention:
    """Resolve devices, split and min_tokens for this patcher; ValueError before anything runs."""
    root = _root_device(model_patcher)
    helpers = parse_devices(",".join(config.helpers)) if config.helpers else None
    if helpers is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        helpers = tuple(torch.device("cuda", i) for i in range(count)
                        if root.type != "cuda" or i != root.index)
    if not helpers:
        raise ValueError(f"Dual-Sage needs a helper GPU besides the root {root}; none is "
                         "visible (set helpers to e.g. 'gpu:0' or disable Dual-Sage)")
    validate_devices(root, helpers)
    heads = _model_heads(model_patcher, config.heads)
    counts = parse_split(config.split, heads, 1 + len(helpers))
    plan = ShardPlan(devices=(root, *helpers), head_counts=counts)
    min_tokens = config.min_tokens
    if min_tokens is None:
        mode = resolve(config.transport, root, helpers[0])
        min_tokens = sizing.choose_min_tokens(
            128, counts, link_gbps=DEFAULT_LINK_GBPS[mode], tflops=[DEFAULT_TFLOPS] * len(counts),
            chunk_heads=config.chunk_heads, host_relay=mode is TransportMode.HOST)
    return ShardedAttention(plan, backend=config.backend, transport=config.transport,
                            min_tokens=min_tokens, chunk_heads=config.chunk_heads,
                            ring_slots=config.ring_slots)


def _unwrap(value: Any) -> Any:
    """A container's tensor (newest ComfyUI's AttentionTensorContainer), or the value itself."""
    if type(value).__name__ == "AttentionTensorContainer" and callable(getattr(value, "take",
                                                                               None)):
        return value.take()
    return value


class DualSageOverride:
    """`optimized_attention_override(func, q, k, v, heads, **kwargs)` running the shard."""

    def __init__(self, sharded: ShardedAttention, previous: Any = None):
        self.sharded = sharded
        self.previous = previous

    def __call__(self, func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any,
                 **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(functools.partial(self.run, func), q, k, v, heads, *args,
                                 **kwargs)
        return self.run(func, q, k, v, heads, *args, **kwargs)

    def run(self, func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any,
            **kwargs: Any) -> Any:
        """Shard when the call is H3's `[1, H, S, D]` unmasked attention, else `func`."""
        q, k, v = _unwrap(q), _unwrap(k), _unwrap(v)
        if not heads_allowed(kwargs.get("transformer_options")):
            # this step runs sequence-parallel (the call is already one GPU's head share) or on
            # one GPU: ComfyUI's function, unchanged
            return func(q, k, v, heads, *args, **kwargs)
        shardable = (not args and kwargs.get("mask") is None and kwargs.get("skip_reshape")
                     and q.dim() == 4 and q.shape[1] == heads and q.shape == k.shape == v.shape)
        if not shardable:
            return func(q, k, v, heads, *args, **kwargs)
        out_BSF = self.sharded(q, k, v)
        if kwargs.get("skip_output_reshape"):
            b, h, s, d = q.shape
            return out_BSF.view(b, s, h, d).transpose(1, 2)
        return out_BSF


def _diffusion_model_wrapper_type() -> str:
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        return "diffusion_model"  # the same value ComfyUI uses (and the twin honours)
    return WrappersMP.DIFFUSION_MODEL


def _root_current_wrapper(root: torch.device):
    def wrapper(executor, *args, **kwargs):
        if root.type != "cuda":
            return executor(*args, **kwargs)
        with torch.cuda.device(root):
            return executor(*args, **kwargs)

    return wrapper


def apply_dual_sage(model_patcher: Any, config: DualSageConfig) -> Any:
    """A clone of `model_patcher` whose attention calls are head-sharded across GPUs."""
    sharded = build_sharded_attention(model_patcher, config)
    patched = model_patcher.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    options["optimized_attention_override"] = DualSageOverride(sharded, previous)
    patched.add_wrapper_with_key(_diffusion_model_wrapper_type(), WRAPPER_KEY,
                                 _root_current_wrapper(sharded.plan.root))
    to = patched.model_options["transformer_options"]
    chained = ", chained after an existing override" if previous is not None else ""
    to["h3_multigpu"] = {**to.get("h3_multigpu", {}), "dual_sage": status_text(sharded) + chained}
    return patched


def status_text(sharded: ShardedAttention) -> str:
    """One line for the node's status output: devices, split, backend, transport, min_tokens."""
    plan = sharded.plan
    modes = sorted({resolve(sharded.transport, plan.root, h).value for h in plan.helpers})
    return (f"Dual-Sage on: root {plan.root}, helpers {', '.join(map(str, plan.helpers))}; "
            f"heads {':'.join(map(str, plan.head_counts))}; backend {sharded.backend_name}; "
            f"transport {'/'.join(modes)}; min_tokens {sharded.min_tokens}")
