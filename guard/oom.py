"""Out of memory mid-run: free what the pack holds, say what ran out and what to change.

ComfyUI 0.33.0 (and the newest files) catches an out-of-memory error in `execution.py`: when
`model_management.is_oom(ex)` it logs a memory summary, unloads every model and shows the
exception's text followed by its own tip ("This error means you ran out of memory on your
GPU ..."). The pack does not replace that: an OUTER_SAMPLE wrapper (installed with the device
guard on every patched DiT) catches the error where the sampling run ends, frees the buffers the
pack keeps between calls, and raises `PackOutOfMemoryError` -- a `torch.OutOfMemoryError`, so
ComfyUI still recognises it and still unloads -- whose text is torch's own message, then ours:
which device ran out at which sampling step and size, what the pack freed, and what to change
(a shorter clip, activation chunking, more block streaming, the planner command).

What the pack keeps between calls, and what an out-of-memory error frees here:
- Dual-Sage: each helper lane's workspace (send/receive buffers on the root, the chunk ring on
  the helper, the pinned relay slots); ComfyUI's ON_CLEANUP (in `outer_sample`'s `finally`)
  already frees them, this checks again for every live `ShardedAttention`;
- the block prefetcher: its device slot ring and its pinned staging ring (the host copies stay,
  registered: they are the model's weights); the next `prepare()` builds the rings again;
- torch's cached device blocks (ComfyUI's `soft_empty_cache`).
The decode's helper replicas live for one decode call only (dropped when it returns or raises).
`pack_memory()` counts all of it, process-wide, for the tests and the benchmark. The features'
live objects come from the seam (`protocol.live`: the states they installed with), the host
buffers from the lower layer (`common.arena`); nothing here reads a feature's module.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comfy_seam import models, protocol
from ..comfy_seam.h3 import sampled_patcher
from ..comfy_seam.names import OOM_GUARD_KEY  # noqa: F401  (tests read it from here)
from ..common.arena import LIVE_BUFFERS

log = logging.getLogger("h3_multigpu")
GIB = 1 << 30
THREAD_PREFIX = "h3-"  # every thread the pack starts is named h3-...


class PackOutOfMemoryError(torch.OutOfMemoryError):
    """torch's out-of-memory error with the pack's explanation appended (ComfyUI's `is_oom`
    still matches it: a subclass of torch.OutOfMemoryError)."""


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error of torch (any device) or of a driver that raises RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


# ------------------------------------------------------------------------------ what we hold
@dataclass(frozen=True)
class PackMemory:
    """What the pack holds in this process beyond the model's own weights."""

    workspaces: int = 0  # Dual-Sage helper lanes with a workspace
    workspace_bytes: int = 0
    slot_bytes: int = 0  # block prefetch device slot rings
    staging_bytes: int = 0  # block prefetch pinned staging rings
    host_buffers: int = 0  # pinned or pageable host buffers alive (arena, staging, relays)
    host_bytes: int = 0
    pinned_bytes: int = 0
    booked_bytes: int = 0  # of those, booked in ComfyUI's pin budget
    threads: tuple[str, ...] = field(default=())  # live threads the pack started

    @property
    def device_bytes(self) -> int:
        return self.workspace_bytes + self.slot_bytes

    def describe(self) -> str:
        return (f"Dual-Sage workspaces {self.workspace_bytes / GIB:.2f} GiB, prefetch slots "
                f"{self.slot_bytes / GIB:.2f} GiB, staging {self.staging_bytes / GIB:.2f} GiB")


def _shards() -> list[Any]:
    """Dual-Sage's `ShardedAttention`s installed on a model still alive."""
    return protocol.live("dual_sage")


def _prefetchers() -> list[Any]:
    """The prefetcher's `BlockPrefetch`es installed on a model still alive."""
    return protocol.live("prefetch")


def pack_memory() -> PackMemory:
    """Count what the pack holds now (features never installed hold nothing)."""
    shards = _shards()
    workspaces = sum(1 for s in shards for h in s._helpers.values() if h.workspace is not None)
    slot_bytes = staging_bytes = 0
    for prefetch in _prefetchers():
        streamer = prefetch.streamer
        if streamer is None:
            continue
        if streamer.slots is not None:
            slot_bytes += streamer.slots.nbytes
        if streamer.staging is not None:
            staging_bytes += streamer.staging.nbytes
    buffers = list(LIVE_BUFFERS)
    return PackMemory(
        workspaces=workspaces, workspace_bytes=sum(s.workspace_bytes() for s in shards),
        slot_bytes=slot_bytes, staging_bytes=staging_bytes, host_buffers=len(buffers),
        host_bytes=sum(b.flat.numel() for b in buffers),
        pinned_bytes=sum(b.region.numel() for b in buffers if b.pinned),
        booked_bytes=sum(b.region.numel() for b in buffers if b.pinned and b.booked),
        threads=tuple(sorted(t.name for t in threading.enumerate()
                             if t.name.startswith(THREAD_PREFIX))))


def release_pack_memory() -> PackMemory:
    """Free the pack's reusable buffers (see the module docstring); returns what was held."""
    held = pack_memory()
    for shard in _shards():
        shard.release()
    for prefetch in _prefetchers():
        streamer = prefetch.streamer
        if streamer is not None and streamer.prepared and not streamer._running:
            streamer.release_device()
    models.empty_cache()
    return held


# ------------------------------------------------------------------------------ the message
_ASKED = re.compile(r"tried to allocate ([0-9.]+ [KMGT]i?B)", re.IGNORECASE)
_GPU = re.compile(r"GPU (\d+) has a total capacity of ([0-9.]+ [KMGT]i?B)")
# torch adds "N GiB allowed" when a per-process memory fraction caps the card: that cap is what
# ran out, not the card's capacity
_ALLOWED = re.compile(r"([0-9.]+ [KMGT]i?B) allowed")


@dataclass
class RunContext:
    """What the sampling run was doing (the OUTER_SAMPLE wrapper fills it)."""

    device: str = "?"
    steps: int = 0  # sampling steps in this run
    done: int = 0  # steps finished before the error
    latent_thw: tuple[int, int, int] | None = None  # video latent frames, height, width
    audio_t: int = 0
    features: tuple[str, ...] = ()

    @property
    def tokens(self) -> int | None:
        if self.latent_thw is None:
            return None
        t, h, w = self.latent_thw
        return t * (h // 2) * (w // 2) + 2 * self.audio_t  # 2x2 patches; two audio rows/step


def _frames(latent_t: int) -> int | None:
    """Frames of a latent on H3's 17k+5 grid (T = 5k + 2), None off the grid."""
    if latent_t >= 2 and (latent_t - 2) % 5 == 0:
        return 5 + 17 * (latent_t - 2) // 5
    return None


def oom_message(exc: BaseException, ctx: RunContext, freed: PackMemory) -> str:
    """torch's message, then where it ran out, what was freed and what to change."""
    text = str(exc).strip()
    asked = _ASKED.search(text)
    gpu = _GPU.search(text)
    allowed = _ALLOWED.search(text)
    where = ctx.device
    if gpu:
        where = (f"gpu:{gpu.group(1)} ({allowed.group(1)} allowed of {gpu.group(2)})" if allowed
                 else f"gpu:{gpu.group(1)} ({gpu.group(2)})")
    size = ""
    if ctx.latent_thw is not None:
        t, h, w = ctx.latent_thw
        size = f"; {w * 16}x{h * 16} px, latent {t} frames, {ctx.tokens:,} video+audio tokens"
    step = f"step {ctx.done + 1} of {ctx.steps}" if ctx.steps else "loading"
    lines = [
        text, "",
        f"H3 multi-GPU: out of memory on {where} at sampling {step}{size}"
        + (f", asking for {asked.group(1)} more" if asked else "")
        + (f"; features on: {', '.join(ctx.features)}" if ctx.features else "") + ".",
        f"The pack freed what it held between calls ({freed.describe()}); ComfyUI stays usable "
        "and the next run needs no restart.",
        "To fit, change one of: a shorter clip (fewer seconds or frames: the activations grow "
        "with the length, attention with its square); FFN/QKV activation chunking (the H3 "
        "Activation Chunking node) for this length; more DiT blocks streamed from host memory "
        "(H3 Block Prefetch with fewer resident_blocks, legacy loader); the second GPU's share "
        "(Dual-Sage heads or sequence parallel).",
    ]
    if ctx.latent_thw is not None:
        t, h, w = ctx.latent_thw
        frames = _frames(t)
        length = f" --frames {frames}" if frames else ""
        lines.append(f"Check first what fits: h3-multigpu plan --gpus auto --width {w * 16} "
                     f"--height {h * 16}{length}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the wrapper
def _latent_shape(args: tuple, kwargs: dict) -> tuple[tuple[int, int, int] | None, int]:
    shapes = kwargs.get("latent_shapes")
    if shapes is None and len(args) > 1 and hasattr(args[1], "shape"):
        shapes = [args[1].shape]
    video = audio = None
    for shape in shapes or ():
        if len(shape) == 5 and video is None:
            video = tuple(int(s) for s in shape[2:])
        elif len(shape) == 4 and audio is None:
            audio = int(shape[-1])
    return video, audio or 0


def _features(patcher: Any) -> tuple[str, ...]:
    return tuple(sorted(protocol.status_lines(patcher)))


def outer_sample_oom_guard(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: an out-of-memory error ends the run with the pack's buffers freed
    and `PackOutOfMemoryError` naming what ran out and what to change."""
    patcher = sampled_patcher(executor)
    ctx = RunContext(device=str(getattr(patcher, "load_device", "?")),
                     features=_features(patcher))
    ctx.latent_thw, ctx.audio_t = _latent_shape(args, kwargs)
    if len(args) > 3 and hasattr(args[3], "shape"):
        ctx.steps = max(int(args[3].shape[-1]) - 1, 0)
    args, kwargs = _count_steps(ctx, args, kwargs)
    try:
        return executor(*args, **kwargs)
    except PackOutOfMemoryError:
        raise  # an inner sampling run (a nested sampler) already explained it
    except Exception as exc:
        if not is_oom(exc):
            raise
        freed = release_pack_memory()
        message = oom_message(exc, ctx, freed)
        log.error("%s", message.split("\n\n", 1)[-1])
        raise PackOutOfMemoryError(message) from exc


def _count_steps(ctx: RunContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Chain the sampler's step callback (argument 6 of outer_sample) to count finished
    steps; the sampler calls it once per step whatever it returns."""
    index = 5
    if len(args) > index:
        previous = args[index]
    else:
        previous = kwargs.get("callback")

    def callback(*cb_args, **cb_kwargs):
        ctx.done += 1
        if previous is not None:
            return previous(*cb_args, **cb_kwargs)
        return None

    if len(args) > index:
        args = (*args[:index], callback, *args[index + 1:])
    else:
        kwargs = {**kwargs, "callback": callback}
    return args, kwargs
