"""`PrefetchConfig` and `apply_block_prefetch`: stream DiT blocks from host memory.

Installs itself on a clone of the patcher through public hooks only:
- a `("double_block", i)` replace patch per DiT block (chaining a patch already there), which
  brackets the block with the streamer's `begin` / `end` when the block is streamed;
- an object patch on `token_refiner.blocks.N.forward` (chaining an earlier one) doing the same;
- a DIFFUSION_MODEL wrapper that, before the block loop, registers the streamed blocks (first
  run) or re-registers changed ones, and sets `transformer_options["prefetch_dynamic_vbars"]`
  to False. ComfyUI's `make_prefetch_queue` returns no queue when that flag is false, so its own
  one-block-ahead staging (DynamicVRAM) does not stage our blocks a second time. ComfyUI writes
  the flag on a copy of the options before calling the model, so we only switch it off for
  this model's forward.

LoRA: ComfyUI patches weights when it loads the model, before the first forward; the wrapper
copies the blocks into the arena at that first forward, so the host copy holds the patched
weights. When ComfyUI re-patches later (new strength, other LoRA) it replaces the parameters,
which the wrapper notices (tensor no longer bound to its host copy) and re-copies that block.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import policy, sizing
from .engine import root_device
from .streamer import BlockStreamer, Source
from .weights import BlockWeights, module_bytes

WRAPPER_KEY = "h3_multigpu.prefetch"
DIFFUSION_MODEL = "diffusion_model"  # ComfyUI's WrappersMP.DIFFUSION_MODEL
GIB = 1 << 30


@dataclass(frozen=True)
class PrefetchConfig:
    """How many DiT blocks stay resident and how the others stream.

    resident_blocks: a count (0..blocks) or "auto" (at the first run: as many as fit in the free
        VRAM minus `activation_reserve_bytes`, leaving room for the slots).
    lookahead: K, how many streamed blocks ahead are copied (K + 1 device slots).
    pinned_budget_bytes: page-locked host memory for block copies; None = half the host's RAM.
        Blocks past it stay pageable and stream through a small pinned staging ring.
    source: "auto" (pinned within the budget, staged beyond), "pinned" (all pinned; the budget
        must cover them), "pageable" (all staged; least pinned memory).
    stream_refiner: stream the token refiner's blocks too (when any DiT block streams).
    """

    resident_blocks: int | str = "auto"
    lookahead: int = 2
    pinned_budget_bytes: int | None = None
    source: str = "auto"
    stream_refiner: bool = True
    activation_reserve_bytes: int = 8 * GIB
    staging_buffers: int = sizing.STAGING_BUFFERS

    def __post_init__(self) -> None:
        r = self.resident_blocks
        if r != "auto" and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"resident_blocks={r!r}: use 'auto' or a block count >= 0")
        if not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ValueError(f"lookahead={self.lookahead!r}: use an integer >= 1 (2 is typical)")
        budget = self.pinned_budget_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"pinned_budget_bytes={budget!r}: use None (half the host RAM) or "
                             "a byte count >= 0")
        if self.source not in {s.value for s in Source}:
            raise ValueError(f"source={self.source!r}: use 'auto', 'pinned' or 'pageable'")
        if self.activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes={self.activation_reserve_bytes}: use >= 0")
        if self.staging_buffers < 1:
            raise ValueError(f"staging_buffers={self.staging_buffers}: use >= 1 (2 is typical)")

    @property
    def source_mode(self) -> Source:
        return Source(self.source)

    @classmethod
    def from_plan(cls, prefetch: Any, **overrides: Any) -> PrefetchConfig:
        """From the planner's `Plan.prefetch` (resident_blocks, lookahead, pinned_budget_bytes)."""
        values = {"resident_blocks": prefetch.resident_blocks, "lookahead": prefetch.lookahead,
                  "pinned_budget_bytes": prefetch.pinned_budget_bytes}
        return cls(**{**values, **overrides})


def host_memory_bytes() -> int | None:
    """Physical host memory, or None when it cannot be read (then the budget is unlimited)."""
    try:
        import psutil  # ComfyUI depends on it; optional here
        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class BlockPrefetch:
    """One patched model's streaming state: residency (resolved at the first run), streamer."""

    def __init__(self, base_model: torch.nn.Module, config: PrefetchConfig,
                 device: torch.device, pinned_budget_bytes: int | None):
        self.base_model = base_model
        diffusion_model = base_model.diffusion_model
        self.diffusion_model = diffusion_model
        self.config = config
        self.device = root_device(device)
        self.pinned_budget_bytes = pinned_budget_bytes
        self.blocks = len(diffusion_model.blocks)
        refiner = getattr(diffusion_model, "token_refiner", None)
        self.refiner_blocks = len(refiner.blocks) if refiner is not None else 0
        self.resident: tuple[int, ...] | None = None
        self.streamer: BlockStreamer | None = None
        self.streamed_ids: frozenset[str] = frozenset()
        self._weights_token: Any = None

    def module(self, block_id: str) -> torch.nn.Module:
        owner: Any = self.diffusion_model
        for part in block_id.split("."):
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        return owner

    def resolve(self) -> None:
        """Decide residency and build the streamer (refusing a too-small pinned budget)."""
        count = self.config.resident_blocks
        if count == "auto":
            count = self._auto_resident()
        count = min(int(count), self.blocks)
        self.resident = policy.spread_resident(self.blocks, count)
        stream_refiner = self.config.stream_refiner and count < self.blocks
        order = policy.streamed_order(self.blocks, self.resident, self.refiner_blocks,
                                      stream_refiner)
        if self.config.source_mode is Source.PINNED and self.pinned_budget_bytes is not None:
            need = sum(module_bytes(self.module(b)) for b in order)
            if need > self.pinned_budget_bytes:
                raise ValueError(
                    f"source='pinned' needs {need / GIB:.2f} GiB of pinned memory for "
                    f"{len(order)} streamed blocks but pinned_budget_bytes allows "
                    f"{self.pinned_budget_bytes / GIB:.2f} GiB; raise the budget, keep more "
                    "blocks resident, or use source='auto'")
        self.streamer = BlockStreamer({b: self.module(b) for b in order}, device=self.device,
                                      lookahead=self.config.lookahead,
                                      pinned_budget_bytes=self.pinned_budget_bytes,
                                      source=self.config.source_mode,
                                      staging_buffers=self.config.staging_buffers)
        self.streamed_ids = frozenset(order)

    def _auto_resident(self) -> int:
        if self.device.type != "cuda":
            return self.blocks  # no VRAM to save on a CPU root
        free, _ = torch.cuda.mem_get_info(self.device)
        modules = [self.module(f"blocks.{i}") for i in range(self.blocks)]
        on_device = sum(BlockWeights("", m).device_bytes(self.device) for m in modules)
        budget = free + on_device - self.config.activation_reserve_bytes
        return sizing.resident_blocks_for_budget(
            budget, blocks=self.blocks, block_bytes=max(module_bytes(m) for m in modules),
            lookahead=self.config.lookahead)

    def prepare(self) -> None:
        """Before a forward's block loop: resolve once, then register or refresh blocks."""
        if self.streamer is None:
            self.resolve()
        assert self.streamer is not None
        # ComfyUI stamps the model with the id of the weight patches it applied; a patch written
        # in place into our host copies leaves pointers unchanged, so the stamp is how we see it
        token = getattr(self.base_model, "current_weight_patches_uuid", None)
        if token != self._weights_token:
            self.streamer.invalidate()
            self._weights_token = token
        self.streamer.prepare()

    def close(self) -> None:
        """Put streamed blocks back on the device; the next forward re-resolves."""
        if self.streamer is not None:
            self.streamer.close()
        self.streamer, self.resident, self.streamed_ids = None, None, frozenset()

    def run(self, block_id: str, call: Callable[[], Any]) -> Any:
        if block_id not in self.streamed_ids:
            return call()
        assert self.streamer is not None
        self.streamer.begin(block_id)
        try:
            return call()
        finally:
            self.streamer.end(block_id)


def apply_block_prefetch(model_patcher: Any, config: PrefetchConfig) -> Any:
    """Clone `model_patcher` and stream its DiT blocks as `config` says. Returns the clone."""
    base_model = model_patcher.model
    blocks = len(base_model.diffusion_model.blocks)
    # refuse bad values before anything is cloned or moved
    if isinstance(config.resident_blocks, int) and config.resident_blocks > blocks:
        raise ValueError(f"resident_blocks={config.resident_blocks} but the model has {blocks} "
                         f"blocks; use 0..{blocks} or 'auto'")
    budget = config.pinned_budget_bytes
    if budget is None:
        host = host_memory_bytes()
        budget = None if host is None else host // 2
    prefetch = BlockPrefetch(base_model, config, model_patcher.load_device, budget)
    if isinstance(config.resident_blocks, int) and config.source_mode is Source.PINNED:
        prefetch.resolve()  # raises on a too-small budget now; moves nothing

    patcher = model_patcher.clone()
    options = patcher.model_options["transformer_options"]
    existing = options.get("patches_replace", {}).get("dit", {})
    for i in range(blocks):
        patch = _block_patch(prefetch, f"blocks.{i}", existing.get(("double_block", i)))
        patcher.set_model_patch_replace(patch, "dit", "double_block", i)
    for j in range(prefetch.refiner_blocks):
        key = f"diffusion_model.token_refiner.blocks.{j}.forward"
        patcher.add_object_patch(key, _forward_patch(prefetch, f"token_refiner.blocks.{j}",
                                                     patcher.get_model_object(key)))
    patcher.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, _wrapper(prefetch))

    options = patcher.model_options["transformer_options"]
    options["h3_multigpu"] = {**options.get("h3_multigpu", {}),
                              "prefetch": _status(config, blocks, budget)}
    return patcher


def get_block_prefetch(model_patcher: Any) -> BlockPrefetch | None:
    """The `BlockPrefetch` installed on a patcher by `apply_block_prefetch`, if any."""
    wrappers = model_patcher.model_options["transformer_options"].get("wrappers", {})
    for fn in wrappers.get(DIFFUSION_MODEL, {}).get(WRAPPER_KEY, []):
        prefetch = getattr(fn, "block_prefetch", None)
        if prefetch is not None:
            return prefetch
    return None


def _block_patch(prefetch: BlockPrefetch, block_id: str, previous: Callable | None) -> Callable:
    def patch(args: dict, extra: dict) -> dict:
        if previous is not None:
            return prefetch.run(block_id, lambda: previous(args, extra))
        return prefetch.run(block_id, lambda: extra["original_block"](args))

    # it only brackets the block with weight copies and never reads the residual stream: the
    # sequence mode keeps its rows split across it (and finds the patches chained inside it)
    patch.h3_multigpu_transparent = True  # type: ignore[attr-defined]
    patch.h3_multigpu_previous = previous  # type: ignore[attr-defined]
    return patch


def _forward_patch(prefetch: BlockPrefetch, block_id: str, original: Callable) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return prefetch.run(block_id, lambda: original(*args, **kwargs))

    return forward


def _wrapper(prefetch: BlockPrefetch) -> Callable:
    def wrapper(executor: Callable, *args: Any, **kwargs: Any) -> Any:
        if prefetch.device.type == "cuda":
            # ComfyUI's kernels (comfy-kitchen's RoPE, current_stream) use the current device:
            # a DiT on cuda:1 must run, and its blocks be prepared, with cuda:1 current
            with torch.cuda.device(prefetch.device):
                return run(executor, *args, **kwargs)
        return run(executor, *args, **kwargs)

    def run(executor: Callable, *args: Any, **kwargs: Any) -> Any:
        prefetch.prepare()
        options = kwargs.get("transformer_options")
        if options is None and len(args) > 3 and isinstance(args[3], dict):
            options = args[3]
        if prefetch.streamed_ids and isinstance(options, dict):
            options["prefetch_dynamic_vbars"] = False  # ComfyUI must not stage our blocks too
        return executor(*args, **kwargs)

    wrapper.block_prefetch = prefetch  # type: ignore[attr-defined]
    return wrapper


def _status(config: PrefetchConfig, blocks: int, budget: int | None) -> str:
    resident = (f"resident auto (free VRAM minus {config.activation_reserve_bytes / GIB:.0f} GiB, "
                "decided at the first run)" if config.resident_blocks == "auto"
                else f"{config.resident_blocks}/{blocks} blocks resident (spread)")
    pinned = "unlimited" if budget is None else f"{budget / GIB:.1f} GiB"
    return (f"block prefetch on: {resident}, look-ahead {config.lookahead} "
            f"({config.lookahead + 1} slots), source {config.source}, pinned budget {pinned}, "
            f"token refiner {'streamed with them' if config.stream_refiner else 'resident'}; "
            "ComfyUI's own block prefetch off while blocks stream")
