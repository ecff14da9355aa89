"""`apply_block_prefetch`: stream DiT blocks from host memory (settings: `config.PrefetchConfig`).

`apply_block_prefetch` clones the patcher and installs the hooks of `comfy_hooks` (public
ComfyUI hooks only): block replace patches and refiner object patches that bracket a streamed
block with the streamer's `begin` / `end`, wrappers that prepare the streamer before the
refiner and the block loop, loader hooks that keep streamed weights off the device, and
lifecycle callbacks. `BlockPrefetch` is the state behind them, one per model and settings.

When things happen in a ComfyUI sampling run:
1. PREPARE_SAMPLING (before ComfyUI's loader): residency is decided once ("auto" from the free
   VRAM) and the patcher's `model_size()` is set to what really goes on the device (resident
   blocks, the rest of the DiT, the slot ring), so `load_models_gpu` frees and counts that.
2. The loader moves the resident part; streamed blocks stay in host memory (their `_apply` is
   patched) and LoRA weights patched into them go to host memory one tensor at a time (their
   `set_<param>` hook), straight into the host copy when it exists.
3. `extra_conds` runs the token refiner once: its first block prepares the streamer (registers
   the host copies the first time, re-copies replaced tensors later) and the refiner blocks
   stream as the prologue of the execution order.
4. Each DiT forward prepares again (cheap when nothing changed) and streams the blocks.
5. ComfyUI unloading the model (ON_DETACH) frees the slots and unpins the host copies; the model
   being garbage collected frees them (nothing but the model's own modules keeps them).
With ComfyUI's DynamicVRAM (a dynamic patcher) the model's weights are already streamed by
ComfyUI (its VBAR per device, its one-block prefetch, its pins), and the prefetcher stands
aside; the status line describes what ComfyUI does instead. On the legacy loader (ROCm below
7.14, --disable-dynamic-vram / --highvram / --gpu-only / --novram / --cpu, older ComfyUI) the
prefetcher streams, its host copies pinned within ComfyUI's pin budget (`comfy_seam.memory`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..comfy_seam import protocol
from ..comfy_seam.interrupts import raise_if_interrupted as check_interrupt
from ..comfy_seam.memory import (
    comfy_pin_budget,
    dynamic_vram_line,
    free_vram_bytes,
    is_dynamic,
    pin_budget_bytes,
)
from ..common.block_weights import leaves_of, module_bytes
from ..common.engine import root_device
from . import policy, sizing
from .config import GIB, PrefetchConfig, host_memory_bytes
from .streamer import BlockStreamer, Source

log = logging.getLogger(__name__)


# one BlockPrefetch per (model, settings): a LoRA or a prefetch node applied again on the same
# model shares the host copies instead of making a second set. Keyed weakly by the DiT module;
# a BlockPrefetch holds the DiT only weakly, so dropping the model frees its host copies.
_INSTANCES: weakref.WeakKeyDictionary[torch.nn.Module, list[BlockPrefetch]] = \
    weakref.WeakKeyDictionary()


class BlockPrefetch:
    """One model's streaming state: residency (resolved before the first load), streamer."""

    def __init__(self, base_model: torch.nn.Module, config: PrefetchConfig,
                 device: torch.device, pinned_budget_bytes: int | None):
        self._base_model = weakref.ref(base_model)
        self._diffusion_model = weakref.ref(base_model.diffusion_model)
        self.config = config
        self.device = root_device(device)
        self.pinned_budget_bytes = pinned_budget_bytes
        diffusion_model = base_model.diffusion_model
        self.blocks = len(diffusion_model.blocks)
        refiner = getattr(diffusion_model, "token_refiner", None)
        self.refiner_blocks = len(refiner.blocks) if refiner is not None else 0
        self.resident: tuple[int, ...] | None = None
        self.streamer: BlockStreamer | None = None
        self.streamed_ids: frozenset[str] = frozenset()
        self._weights_token: Any = None
        self.comfy_lowvram_modules = 0  # modules ComfyUI's own lowvram load casts on use

    @property
    def base_model(self) -> torch.nn.Module:
        model = self._base_model()
        if model is None:
            raise RuntimeError("the model this prefetcher streams was garbage collected")
        return model

    @property
    def diffusion_model(self) -> torch.nn.Module:
        model = self._diffusion_model()
        if model is None:
            raise RuntimeError("the model this prefetcher streams was garbage collected")
        return model

    @property
    def block_ids(self) -> list[str]:
        """Every block that can stream: the DiT blocks, then the token refiner's."""
        return ([f"blocks.{i}" for i in range(self.blocks)]
                + [f"token_refiner.blocks.{j}" for j in range(self.refiner_blocks)])

    def module(self, block_id: str) -> torch.nn.Module:
        owner: Any = self.diffusion_model
        for part in block_id.split("."):
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        return owner

    # ------------------------------------------------------------------ residency
    def resolve(self, patcher: Any = None) -> None:
        """Decide residency and build the streamer (refusing a too-small pinned budget).
        `patcher`: the ComfyUI patcher about to load the model (its free-memory query)."""
        count = self.config.resident_blocks
        if count == "auto":
            count = self._auto_resident(patcher)
        count = min(int(count), self.blocks)
        resident = policy.spread_resident(self.blocks, count)
        stream_refiner = self.config.stream_refiner and count < self.blocks
        order = policy.streamed_order(self.blocks, resident, self.refiner_blocks,
                                      stream_refiner)
        budget = pin_budget_bytes(self.pinned_budget_bytes) if self.device.type == "cuda" \
            else self.pinned_budget_bytes
        if self.config.source_mode is Source.PINNED and budget is not None:
            need = sum(module_bytes(self.module(b)) for b in order)
            if need > budget:
                comfy = comfy_pin_budget()
                limit = (f"ComfyUI's pin budget has {budget / GIB:.2f} GiB left "
                         f"({comfy.describe()})" if comfy is not None and
                         (self.pinned_budget_bytes is None or budget < self.pinned_budget_bytes)
                         else f"pinned_budget_bytes allows {budget / GIB:.2f} GiB")
                raise ValueError(
                    f"source='pinned' needs {need / GIB:.2f} GiB of pinned memory for "
                    f"{len(order)} streamed blocks but {limit}; raise the budget, keep more "
                    "blocks resident, or use source='auto'")
        prologue = [b for b in order if b.startswith("token_refiner.")]
        self.streamer = BlockStreamer({b: self.module(b) for b in order}, device=self.device,
                                      lookahead=self.config.lookahead,
                                      pinned_budget_bytes=self.pinned_budget_bytes,
                                      source=self.config.source_mode,
                                      staging_buffers=self.config.staging_buffers,
                                      prologue=prologue)
        self.resident = resident
        self.streamed_ids = frozenset(order)

    def ensure_resolved(self, patcher: Any = None) -> None:
        if self.streamer is None:
            self.resolve(patcher)

    def is_streamed(self, block_id: str) -> bool:
        self.ensure_resolved()
        return block_id in self.streamed_ids

    def _auto_resident(self, patcher: Any = None) -> int:
        free = free_vram_bytes(self.device, patcher)  # ComfyUI's count inside ComfyUI
        if free is None:
            return self.blocks  # no VRAM to save on a CPU root
        model = self.diffusion_model
        on_device = _device_bytes(model, self.device)  # ours already: reusable
        block_modules = [self.module(b) for b in self.block_ids]
        block_bytes = max(module_bytes(m) for m in block_modules)
        refiner = self.refiner_blocks * block_bytes
        other = module_bytes(model) - sum(module_bytes(m) for m in block_modules)
        budget = free + on_device - self.config.activation_reserve_bytes - other
        if not self.config.stream_refiner:
            budget -= refiner  # the refiner stays resident whatever streams
        # the planner's arithmetic (offload.sizing): the refiner streams with the blocks
        return sizing.resident_blocks_for_budget(
            budget, blocks=self.blocks, block_bytes=block_bytes, lookahead=self.config.lookahead,
            extra_streamed=self.refiner_blocks if self.config.stream_refiner else 0)

    def device_footprint_bytes(self) -> int:
        """What ComfyUI's loader really puts on the device for this model: its whole size
        minus the streamed blocks, plus the slot ring (ComfyUI's `module_size` measure)."""
        self.ensure_resolved()
        assert self.streamer is not None
        full = _state_bytes(self.base_model)
        streamed = sum(_state_bytes(self.module(b)) for b in self.streamed_ids)
        largest = max((module_bytes(self.module(b)) for b in self.streamed_ids), default=0)
        slots = sizing.slot_ring_bytes(largest, self.config.lookahead, len(self.streamed_ids))
        return full - streamed + slots

    # ------------------------------------------------------------------ running
    def prepare(self) -> None:
        """Before the refiner or a forward's block loop: resolve once, then register or
        refresh blocks and invalidate slot copies when ComfyUI re-patched weights in place."""
        self.ensure_resolved()
        assert self.streamer is not None
        if not self.streamer.prepared and self.streamed_ids:
            self._claim_model()
        # ComfyUI stamps the model with the id of the weight patches it applied; a patch written
        # in place into our host copies leaves pointers unchanged, so the stamp is how we see it
        token = getattr(self.base_model, "current_weight_patches_uuid", None)
        if token != self._weights_token:
            self.streamer.invalidate()
            self._weights_token = token
        self.streamer.prepare()

    def _claim_model(self) -> None:
        """Another prefetcher (other settings) on this model lets go of its host copies."""
        for other in list(_INSTANCES.get(self.diffusion_model, [])):
            if other is not self and other.streamer is not None and other.streamer.prepared:
                log.info("block prefetch: taking over the model from a prefetcher with other "
                         "settings")
                other.release(torch.device("cpu"))

    def run(self, block_id: str, call: Callable[[], Any]) -> Any:
        if block_id not in self.streamed_ids:
            return call()
        assert self.streamer is not None
        # a cancel lands here, before the next block's weights are copied in, rather than in
        # the block's first layer after the copy
        check_interrupt()
        self.streamer.begin(block_id)
        try:
            return call()
        finally:
            self.streamer.end(block_id)

    def place_weight(self, block_id: str, owner: torch.nn.Module, name: str,
                     value: torch.Tensor) -> None:
        """ComfyUI's `set_attr_param(owner.<name>, value)` for a patched weight: a streamed
        block's weight goes to its host copy (never stays on the device)."""
        setattr(owner, name, torch.nn.Parameter(value, requires_grad=False))
        if block_id not in self.streamed_ids:
            return
        assert self.streamer is not None
        if not self.streamer.adopt(block_id, owner, name) and value.device.type != "cpu":
            # not registered yet (first load) or a new shape: a host tensor the next
            # prepare() copies in; the device copy is dropped here
            getattr(owner, name).data = value.to("cpu")

    # ------------------------------------------------------------------ lifecycle
    def on_load(self, patcher: Any) -> None:
        """After ComfyUI's loader: note whether its own lowvram partial load streams too."""
        model = patcher.model
        was = self.comfy_lowvram_modules
        self.comfy_lowvram_modules = sum(
            1 for m in model.modules() if getattr(m, "comfy_cast_weights", False)) \
            if getattr(model, "model_lowvram", False) else 0
        if self.comfy_lowvram_modules and self.streamed_ids and not was:
            log.warning("block prefetch: VRAM is short of the plan; ComfyUI's lowvram partial "
                        "load also streams %d modules (cast on each use)",
                        self.comfy_lowvram_modules)

    def on_detach(self, patcher: Any, unpatch_all: bool) -> None:
        """ComfyUI took the model off the device (or is handing it to another clone)."""
        if self.streamer is None or not self.streamer.prepared:
            return
        self.streamer.release_device()  # the model left the device: so do the slots
        if unpatch_all:
            # ComfyUI restored its backups into the model: take them into the host copies now
            # instead of holding both until the next run, then unlock the pages
            self.streamer.refresh_host()
            self.streamer.unpin()
        elif self.streamed_ids:
            # weights stay "loaded" for the next clone of this model; streamed blocks are not on
            # the device, so make ComfyUI's loader look at every module again (a clone without
            # this prefetcher then moves them; one with it keeps them streamed)
            patcher.model.model_lowvram = True

    def release(self, device: torch.device | None = None) -> None:
        """Stop streaming: streamed tensors get storage of their own on `device` (default the
        root device), the host copies and slots are freed; the next run resolves again."""
        if self.streamer is not None:
            self.streamer.close(self.device if device is None else device)
        self.streamer, self.resident, self.streamed_ids = None, None, frozenset()

    def close(self) -> None:
        """Put streamed blocks back on the device; the next forward re-resolves."""
        self.release(self.device)


def _device_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Bytes of `module`'s tensors (quantized leaves included) that live on `device`."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(
        leaf.numel() * leaf.element_size() for t in tensors for _, leaf in leaves_of(t)
        if leaf.device == device)


def _state_bytes(module: torch.nn.Module) -> int:
    """ComfyUI's `module_size`: bytes of the module's state dict."""
    return sum(t.nelement() * t.element_size() for t in module.state_dict().values())


def _shared_prefetch(base_model: torch.nn.Module, config: PrefetchConfig, device: torch.device,
                     budget: int | None) -> BlockPrefetch:
    instances = _INSTANCES.setdefault(base_model.diffusion_model, [])
    for prefetch in instances:
        if (prefetch.config == config and prefetch.device == root_device(device)
                and prefetch.pinned_budget_bytes == budget
                and prefetch._base_model() is base_model):
            return prefetch
    prefetch = BlockPrefetch(base_model, config, device, budget)
    instances.append(prefetch)
    return prefetch


def apply_block_prefetch(model_patcher: Any, config: PrefetchConfig) -> Any:
    """Clone `model_patcher` and stream its DiT blocks as `config` says. Returns the clone."""
    from . import comfy_hooks

    base_model = model_patcher.model
    blocks = len(base_model.diffusion_model.blocks)
    # refuse bad values before anything is cloned or moved
    if isinstance(config.resident_blocks, int) and config.resident_blocks > blocks:
        raise ValueError(f"resident_blocks={config.resident_blocks} but the model has {blocks} "
                         f"blocks; use 0..{blocks} or 'auto'")
    budget = config.pinned_budget_bytes
    if budget is None and comfy_pin_budget() is None:
        host = host_memory_bytes()  # outside ComfyUI: half the host's RAM
        budget = None if host is None else host // 2
    patcher = model_patcher.clone()
    if is_dynamic(model_patcher):
        # ComfyUI streams this model itself: a second streamer would copy every block twice
        protocol.record_status(patcher, "prefetch", (
            "off: ComfyUI's DynamicVRAM streams this model's weights, the block prefetcher "
            f"stands aside; {dynamic_vram_line(model_patcher)}"))
        return patcher
    prefetch = _shared_prefetch(base_model, config, model_patcher.load_device, budget)
    if isinstance(config.resident_blocks, int) and config.source_mode is Source.PINNED \
            and prefetch.streamer is None:
        prefetch.resolve()  # raises on a too-small budget now; moves nothing
    comfy_hooks.install(patcher, prefetch)
    protocol.record_status(patcher, "prefetch", _status(config, blocks, budget))
    return patcher


def get_block_prefetch(model_patcher: Any) -> BlockPrefetch | None:
    """The `BlockPrefetch` installed on a patcher by `apply_block_prefetch`, if any."""
    return protocol.find(model_patcher, "prefetch")


def _status(config: PrefetchConfig, blocks: int, budget: int | None) -> str:
    resident = (f"resident auto (free VRAM minus {config.activation_reserve_bytes / GIB:.0f} GiB, "
                "decided before the first load)" if config.resident_blocks == "auto"
                else f"{config.resident_blocks}/{blocks} blocks resident (spread)")
    comfy = comfy_pin_budget()
    if comfy is not None:  # inside ComfyUI: its budget, ours capped by it
        pinned = comfy.describe() if budget is None else \
            f"{budget / GIB:.1f} GiB within {comfy.describe()}"
    else:
        pinned = "unlimited" if budget is None else f"{budget / GIB:.1f} GiB"
    refiner = ("streamed once per sampling run, ahead of the blocks" if config.stream_refiner
               else "resident")
    return (f"block prefetch on: {resident}, look-ahead {config.lookahead} "
            f"({config.lookahead + 1} slots), source {config.source}, pinned budget {pinned}, "
            f"token refiner {refiner}; streaming: this prefetcher (ComfyUI's loader moves only "
            "the resident part; its own block prefetch is off while blocks stream; a lowvram "
            "partial load by ComfyUI is logged if VRAM runs short of the plan)")
