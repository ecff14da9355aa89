"""`DualSageConfig` and `apply_dual_sage(model_patcher, config)`.

Installs, on a clone of the patcher, through the seam (`comfy_seam.protocol`, feature
"dual_sage"):
1. an `optimized_attention_override` in `transformer_options` that shards each H3 attention
   call's heads over the GPUs, running on every head subset THE FUNCTION COMFYUI WOULD HAVE RUN
   (`ShardingFunction`): the module's preferred attention (`ComfyAttention.function`, e.g. a
   checkpoint's `comfy_attention.config` selecting comfy-kitchen int8) when set, else the
   `func` ComfyUI hands the override (its default: sub-quadratic on CPU, SDPA with ComfyUI's
   backend priority on CUDA, or sage/flash/xformers per its flags);
2. a `("double_block", i)` replace patch per DiT block (chaining a patch already there) that
   records which attention module is running: ComfyUI's `wrap_attn` pops `preferred_attention`
   before it calls an override, so the override reads the module's `comfy_attention` here;
3. a DIFFUSION_MODEL wrapper that makes the root GPU current while the DiT runs;
4. ComfyUI ON_CLEANUP / ON_DETACH callbacks that free the helper workspaces and forget helper
   failures after each sampling run and when the model is unloaded.
Its state is the `ShardedAttention` (`protocol.find(patcher, "dual_sage")` answers it, and
`protocol.live("dual_sage")` lists it for the out-of-memory guard). The override and the
function it shards: `override`.

Chaining, both directions:
- an override installed BEFORE Dual-Sage keeps priority: it is called with a `ShardingFunction`
  as its `func`, so it sees every call and decides; calling through shards ComfyUI's function,
  and an override that wants its own kernel sharded calls `func.with_function(kernel)` (our
  SageAttention node does);
- an override installed AFTER Dual-Sage calls us with its own function: we shard that one.
Calls the shard cannot take (a mask, the `[B, S, H*D]` layout, unknown positional extras) go to
the chosen function unchanged, with every keyword passed on.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..comfy_seam import names, protocol
from ..comfy_seam.attention import recorder_patches
from ..comfy_seam.devices import device_context, gpu_count
from ..comfy_seam.h3 import default_attention as seam_default_attention
from ..common import geometry
from ..common.devices import parse_devices, validate_devices
from ..common.exactness import ExactRange, claim, function_name
from ..exchange.transport import TransportMode, resolve
from ..kernels import backend_names, backend_refusal
from ..kernels.comfy_calling import backend_function
from . import sizing
from .override import (  # noqa: F401  (ShardingFunction, per_heads: read from here too)
    COMFYUI_FUNCTION,
    DualSageOverride,
    ShardingFunction,
    attention_modules,
    per_heads,
)
from .shard_plan import ShardPlan, parse_split
from .sharded import ShardedAttention

log = logging.getLogger(__name__)

DEFAULT_LINK_GBPS = {TransportMode.PEER: 300.0, TransportMode.HOST: 25.0}
DEFAULT_TFLOPS = 550.0  # bf16 attention of one current GPU; only the ratio between GPUs matters


@dataclass
class DualSageConfig:
    """Head-sharded attention over the root GPU and helper GPUs.

    helpers: helper devices ("cuda:0", ...) or None for every other visible GPU.
    split: "auto" (equal), head counts "28:28" (root first) or throughputs "1.0:0.7".
    backend: "comfyui" (shard the function ComfyUI would run: exact) or a `kernels` backend
        name ("sdpa", "ck_int8", ...) chosen explicitly.
    min_tokens: calls shorter than this stay on the root; None chooses from the link.
    transport: "auto" (peer when possible), "peer" or "host" (pinned host relay).
    exact_only: split only inside the measured bit-exact range (`exactness`); False splits
        every call above min_tokens (approximate in the last bits where it is outside).
    """

    helpers: tuple[str, ...] | None = None
    split: str = "auto"
    backend: str = COMFYUI_FUNCTION
    min_tokens: int | None = None
    transport: TransportMode | str = TransportMode.AUTO
    chunk_heads: int | None = None  # None: by transport (sizing.chunk_heads_for)
    ring_slots: int = sizing.DEFAULT_RING_SLOTS
    exact_only: bool = True
    heads: int = geometry.HEADS  # used when the model does not say

    def __post_init__(self) -> None:
        self.transport = TransportMode.parse(self.transport)
        self.backend = self.backend.strip()
        if self.backend != COMFYUI_FUNCTION and self.backend not in backend_names():
            raise ValueError(f"attention backend {self.backend!r} is unknown; use "
                             f"{COMFYUI_FUNCTION!r} or one of {backend_names()}")
        refusal = backend_refusal(self.backend)
        if refusal is not None:
            raise ValueError(f"backend={self.backend!r}: {refusal}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0 (or 'auto')")
        if (self.chunk_heads is not None and self.chunk_heads < 1) or self.ring_slots < 1:
            raise ValueError(f"chunk_heads={self.chunk_heads} and ring_slots={self.ring_slots} "
                             "must be at least 1")
        if self.helpers is not None:
            self.helpers = tuple(str(d) for d in self.helpers)

    @classmethod
    def from_strings(cls, helpers: str = "auto", split: str = "auto",
                     backend: str = COMFYUI_FUNCTION, min_tokens: str | int = "auto",
                     transport: str = "auto", exact_only: bool = True) -> DualSageConfig:
        """What a node passes: helpers "auto"|"gpu:0,gpu:2", min_tokens "auto"|int."""
        if not isinstance(helpers, str):
            raise ValueError(f"helpers {helpers!r:.60} must be text such as 'gpu:0,gpu:2' or "
                             "'auto'")
        devices = parse_devices(helpers)
        refused = ValueError(f"min_tokens {min_tokens!r:.60} must be 'auto' or a whole number of "
                             "tokens, e.g. 8192")
        if isinstance(min_tokens, str):
            text = min_tokens.strip().lower()
            if text in ("auto", ""):
                tokens = None
            elif text.isascii() and text.isdigit() and len(text) <= 15:  # not '²' nor 4300 digits
                tokens = int(text)
            else:
                raise refused
        elif isinstance(min_tokens, bool) or not isinstance(min_tokens, (int, float)):
            raise refused
        elif isinstance(min_tokens, float) and not (math.isfinite(min_tokens)
                                                    and min_tokens.is_integer()):
            raise refused  # inf would be an OverflowError, nan a raw int() message
        else:
            tokens = int(min_tokens)
        # Parse the split now, for H3's heads and the named helpers (or as many devices as it
        # has entries), so a typo is refused when the node is validated, not when it runs.
        if not isinstance(backend, str):
            raise ValueError(f"attention backend {backend!r:.60} must be a name such as "
                             f"{COMFYUI_FUNCTION!r}")
        if not isinstance(split, str):
            raise ValueError(f"head split {split!r} must be text such as '28:28' or 'auto'")
        if split.strip().lower() not in ("auto", ""):
            entries = len(split.replace(",", ":").split(":"))
            parse_split(split, cls.heads, 1 + len(devices) if devices else max(2, entries))
        return cls(helpers=None if devices is None else tuple(str(d) for d in devices),
                   split=split, backend=backend, min_tokens=tokens, transport=transport,
                   exact_only=bool(exact_only))


def _diffusion_model(model_patcher: Any) -> Any:
    with contextlib.suppress(AttributeError, KeyError):
        return model_patcher.get_model_object("diffusion_model")
    return None


def _model_heads(diffusion_model: Any, default: int) -> int:
    """The DiT's attention head count (first block), or `default`."""
    with contextlib.suppress(AttributeError, IndexError, TypeError):
        heads = diffusion_model.blocks[0].attn.heads
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
        count = gpu_count()  # the GPUs ComfyUI uses (--cuda-device), not all torch sees
        helpers = tuple(torch.device("cuda", i) for i in range(count)
                        if root.type != "cuda" or i != root.index)
    if not helpers:
        raise ValueError(f"Dual-Sage needs a helper GPU besides the root {root}; none is "
                         "visible (set helpers to e.g. 'gpu:0' or disable Dual-Sage)")
    validate_devices(root, helpers)
    heads = _model_heads(_diffusion_model(model_patcher), config.heads)
    counts = parse_split(config.split, heads, 1 + len(helpers))
    plan = ShardPlan(devices=(root, *helpers), head_counts=counts)
    mode = resolve(config.transport, root, helpers[0])
    chunk_heads = config.chunk_heads or sizing.chunk_heads_for(mode is TransportMode.HOST)
    min_tokens = config.min_tokens
    if min_tokens is None:
        min_tokens = sizing.choose_min_tokens(
            128, counts, link_gbps=DEFAULT_LINK_GBPS[mode], tflops=[DEFAULT_TFLOPS] * len(counts),
            chunk_heads=chunk_heads, host_relay=mode is TransportMode.HOST)
    return ShardedAttention(plan, transport=config.transport, min_tokens=min_tokens,
                            chunk_heads=chunk_heads, ring_slots=config.ring_slots,
                            exact_range=ExactRange.load() if config.exact_only else None)


def _root_current_wrapper(root: torch.device):
    def wrapper(executor, *args, **kwargs):
        # nests with any other device guard (the placement's): entering the same device twice
        # is harmless and each exit restores what was current before it
        with device_context(root):
            return executor(*args, **kwargs)

    return wrapper


def get_sharded_attention(model_patcher: Any) -> ShardedAttention | None:
    """Dual-Sage's sharded attention on a patcher (the state it installed with), wherever its
    override sits in the chain (chunking's head groups, the SageAttention node may wrap it)."""
    return protocol.find(model_patcher, "dual_sage")


def apply_dual_sage(model_patcher: Any, config: DualSageConfig) -> Any:
    """A clone of `model_patcher` whose attention calls are head-sharded across GPUs."""
    if config.backend != COMFYUI_FUNCTION:
        backend_function(config.backend)  # ValueError now if this machine cannot run it
    sharded = build_sharded_attention(model_patcher, config)
    patched = model_patcher.clone()
    diffusion_model = _diffusion_model(patched)
    previous = protocol.override_of(patched)
    protocol.install(
        patched, "dual_sage",
        protocol.override(lambda prev: DualSageOverride(sharded, prev, config.backend,
                                                        diffusion_model)),
        *recorder_patches(diffusion_model),
        protocol.wrapper(names.DIFFUSION_MODEL, _root_current_wrapper(sharded.plan.root)),
        protocol.callback(names.ON_CLEANUP, lambda *_: sharded.release()),
        protocol.callback(names.ON_DETACH, lambda *_: sharded.release()),
        state=sharded)
    protocol.record_status(patched, "dual_sage", status_text(
        sharded, config, previous, function_names=functions_run(config, previous,
                                                                diffusion_model)))
    return patched


def _node_backend(previous: Any) -> str | None:
    """The backend of the H3 Sage Attention node when its override is the one Dual-Sage wraps
    (the seam says who installed it; the node installs with its choice as state)."""
    info = protocol.link_info(previous)
    if info is None or info.feature != "attention" or info.state is None:
        return None
    return info.state.backend


_SAGE_NODE_BACKENDS: dict[str, str] = {}  # words -> backend, for the claim of a status re-made


def sage_node_words(backend: str) -> str:
    words = f"the H3 Sage Attention node's backend {backend}"
    _SAGE_NODE_BACKENDS[words] = backend
    return words


def default_attention(diffusion_model: Any) -> Any:
    """The attention function the H3 module calls when nothing prefers another: ComfyUI's
    `optimized_attention` as the module imported it (the startup flags' choice: sub-quadratic
    on CPU, SDPA on CUDA, sage/flash/xformers by flag), or the twin's
    (`comfy_seam.h3.default_attention`)."""
    blocks = getattr(diffusion_model, "blocks", None) or []
    return seam_default_attention(blocks[0]) if blocks else None


def functions_run(config: DualSageConfig, previous: Any, diffusion_model: Any
                  ) -> tuple[str, ...] | None:
    """The names of the attention functions the split calls will run (`function_for`), as far
    as they are known when Dual-Sage is applied: None when an override installed before
    decides per call. Newest files: each module's preferred attention where one is set; 0.33.0
    has none (no ComfyAttention), so its `optimized_attention` is what runs."""
    chosen = _node_backend(previous)
    if chosen is not None:
        return (chosen,)
    if previous is not None:
        return None
    if config.backend != COMFYUI_FUNCTION:
        return (config.backend,)
    names = set()
    default = default_attention(diffusion_model)
    modules = attention_modules(diffusion_model)
    for module in modules:
        preferred = getattr(module.comfy_attention, "function", None)
        if preferred is not None:
            names.add(function_name(preferred))
    if default is not None and (not modules or any(
            getattr(m.comfy_attention, "function", None) is None for m in modules)):
        names.add(function_name(default))
    return tuple(sorted(names)) or None


def _function_words(config: DualSageConfig, previous: Any) -> str:
    chosen = _node_backend(previous)
    if chosen is not None:
        return sage_node_words(chosen)
    if config.backend != COMFYUI_FUNCTION:
        return f"backend {config.backend} (chosen here)"
    if previous is not None:
        return "ComfyUI's attention, through the override installed before (chained)"
    return "ComfyUI's attention (the checkpoint's preferred where this ComfyUI has it, else " \
        "its optimized_attention)"


def status_text(sharded: ShardedAttention, config: DualSageConfig | None = None,
                previous: Any = None, function: str | None = None,
                function_names: tuple[str, ...] | None = None) -> str:
    """One line for the node's status output: devices, split, function, exactness, transport.

    function_names: the attention functions the split calls run (`functions_run`); the line
    says "exact: yes" only when every one is measured per head subset on the root's device
    type (`exactness.claim`), else "exact: no, <why>"."""
    if function_names is None and function in _SAGE_NODE_BACKENDS:
        function_names = (_SAGE_NODE_BACKENDS[function],)
    function = function or _function_words(config or DualSageConfig(), previous)
    plan = sharded.plan
    modes = sorted({resolve(sharded.transport, plan.root, h).value for h in plan.helpers})
    claims = [claim(plan.root, name, sharded.exact_range) for name in function_names or (None,)]
    exact = next((c for c in claims if not c.startswith("exact: yes")), claims[0])
    return (f"Dual-Sage on: root {plan.root}, helpers {', '.join(map(str, plan.helpers))}; "
            f"heads {':'.join(map(str, plan.head_counts))}; shards {function}; {exact}; "
            f"transport {'/'.join(modes)}; min_tokens {sharded.min_tokens}")
