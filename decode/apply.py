"""ComfyUI seam: `MultiGPUDecodeConfig` and `apply_multi_gpu_decode(vae, config)`.

The seam is a method-level object patch on the VAE's model, `decode_temporal` (the upstream
H3 video VAE's window loop), added to a clone of the VAE's ModelPatcher. ComfyUI's own
`VAE.decode` stays in charge of everything around the window loop: loading the root copy with
its memory estimate, the single float32 output buffer it preallocates on the host (each GPU's
window loop writes into it directly), the de-normalisation of the latent, the OOM fallback and
the output layout. So the stock VAE Decode node, and every other node that decodes through this
VAE, decodes on several GPUs without a change to the graph, and ComfyUI removes the patch when it
unloads the clone. Inside the patch each GPU runs the VAE's own `decode_temporal` on its windows
(`decode.executor`, `decode.release`).

Where a helper's decoder comes from (`helper_copy`):
- "comfy": ComfyUI's own multi-GPU clone of the VAE (`ModelPatcher.deepclone_multigpu`, what
  Select VAE Device uses), made when the patch is applied and loaded on the helper by ComfyUI
  (`load_models_gpu`) at each decode. Under DynamicVRAM this is the only way ("auto" picks it):
  the root's weights are VBAR-managed and must never be copied module by module.
- "copy": a copy of the root's loaded decoder, tensor by tensor (`decode.replica`): no second
  read of the file, no host memory; "auto" picks it when DynamicVRAM is off.

At each call the patch decides again, from the latent and the GPUs as they are then: helpers
whose free memory cannot take a decoder copy (after asking ComfyUI to unload models there, if
`make_room`) are left out with a reason; with no helper left, or too few windows to share, the
model's own loop runs unchanged. `patch.last_line` says what happened.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..comfy_seam import interrupts, models, names, protocol
from ..comfy_seam.devices import gpu_count
from ..comfy_seam.memory import is_dynamic
from ..common.devices import parse_devices, validate_devices
from . import sizing
from .executor import SplitDecode
from .release import check_splittable, release_shape
from .replica import CloneMissing, check_replicable, comfy_clone, replica_bytes
from .shares import DecodeReport, DeviceShare, NotFollowed
from .windows import WindowLayout, assign_windows, parse_weights

log = logging.getLogger("h3_multigpu")

PATCH_NAME = names.VAE_DECODE_LOOP
COPY_GBS = {"peer": 100.0, "host": 10.0}  # decoder copy rate for the share plan (conservative)


class HelperCopy(str, Enum):
    AUTO = "auto"  # ComfyUI's clone under DynamicVRAM, else a copy of the loaded decoder
    COMFY = "comfy"  # ComfyUI's multi-GPU clone (deepclone_multigpu), loaded by ComfyUI
    COPY = "copy"  # a copy of the root's loaded decoder (refused under DynamicVRAM)


@dataclass
class MultiGPUDecodeConfig:
    """Share the video VAE's windows between the VAE's GPU (root) and helper GPUs.

    helpers: helper devices ("cuda:0", ...) or None for every other visible GPU.
    shares: relative speeds, root first ("1:0.7"), or None: equal.
    make_room: let ComfyUI unload models from a helper GPU when the decoder copy does not fit.
    min_windows: below this many windows the decode stays on the root.
    helper_copy: where a helper's decoder comes from: "auto", "comfy" or "copy" (see above).
    """

    helpers: tuple[str, ...] | None = None
    shares: tuple[float, ...] | None = None
    make_room: bool = True
    min_windows: int = 2
    helper_copy: str = HelperCopy.AUTO.value

    def __post_init__(self) -> None:
        if self.min_windows < 2:
            raise ValueError(f"min_windows={self.min_windows}: sharing needs at least 2 windows")
        try:
            self.helper_copy = HelperCopy(str(self.helper_copy).strip().lower()).value
        except ValueError:
            raise ValueError(f"helper_copy={self.helper_copy!r}: use 'auto', 'comfy' (ComfyUI's "
                             f"multi-GPU clone) or 'copy' (a copy of the loaded decoder)") from None
        if self.helpers is not None:
            self.helpers = tuple(str(d) for d in self.helpers)
        if self.shares is not None:
            self.shares = tuple(float(s) for s in self.shares)
            if any(not 0 < s < math.inf for s in self.shares):
                raise ValueError(f"decode shares {self.shares} must all be positive and finite "
                                 "(relative speeds, root first, e.g. (1.0, 0.7))")

    @classmethod
    def from_strings(cls, helpers: str = "auto", shares: str = "auto",
                     make_room: bool = True) -> MultiGPUDecodeConfig:
        for name, value, example in (("helpers", helpers, "'gpu:0'"),
                                     ("shares", shares, "'1:0.7'")):
            if not isinstance(value, str):
                raise ValueError(f"decode {name} {value!r:.60} must be text such as {example} "
                                 "or 'auto'")
        devices = parse_devices(helpers)
        count = None if devices is None else len(devices) + 1
        weights = None
        if shares.strip().lower() not in ("", "auto"):
            if count is None:
                raise ValueError("decode shares need an explicit helper list (they are given "
                                 "root first, then one per helper)")
            weights = parse_weights(shares, count)
        return cls(helpers=None if devices is None else tuple(str(d) for d in devices),
                   shares=weights, make_room=make_room)


@dataclass
class Helper:
    """A helper device and, for "comfy", ComfyUI's clone of the VAE's patcher for it."""

    device: torch.device
    patcher: Any | None = None  # None: a copy of the root's loaded decoder at each decode


def _helper_devices(config: MultiGPUDecodeConfig, root: torch.device) -> list[torch.device]:
    if config.helpers is not None:
        devices = list(parse_devices(",".join(config.helpers)) or ())
        validate_devices(root, devices)
        return devices
    if root.type != "cuda" or not torch.cuda.is_available():
        return []
    index = root.index if root.index is not None else torch.cuda.current_device()
    return [torch.device("cuda", i) for i in range(gpu_count()) if i != index]


def _decode_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype the decoder computes in (a QuantizedTensor reports its logical dtype)."""
    for p in model.decoder.parameters() if hasattr(model, "decoder") else ():
        return p.dtype
    return None


class MultiGPUDecode:
    """The object patched in for the model's `decode_temporal(z, output_buffer=None)`."""

    def __init__(self, model: torch.nn.Module, config: MultiGPUDecodeConfig,
                 helpers: list[Helper] | None = None, memory_for: Any = None) -> None:
        self.model = model
        self.config = config
        self.helpers = list(helpers or [])
        self.memory_for = memory_for  # the VAE's memory_used_decode(shape, dtype), if known
        self.calls = 0  # decodes that went through the patch
        self.split_calls = 0  # of which shared between devices
        self.last_report: DecodeReport | None = None
        self.last_line = "not run yet"

    # --- planning a call --------------------------------------------------------------------

    def _room(self, device: torch.device, need: int, patcher: Any = None) -> str | None:
        """None when `device` has `need` bytes free now (after ComfyUI made room there, if
        allowed), else why not."""
        if device.type != "cuda":
            return None
        free = models.free_bytes(device, patcher)
        if free is None:
            return None
        if free < need and self.config.make_room:
            models.make_room(need, device)  # ComfyUI unloads models there, as for any load
            free = models.free_bytes(device, patcher) or 0
        if free < need:
            return (f"{device} has {free / sizing.GiB:.1f} GiB free, a decoder and its windows "
                    f"need {need / sizing.GiB:.1f} GiB")
        return None

    def _helper_model(self, helper: Helper, z_BCTHW: torch.Tensor, work: int
                      ) -> tuple[torch.nn.Module | None, str | None]:
        """(model to decode with there, None) or (None, why the helper is left out)."""
        if helper.patcher is None:  # a copy of the root's decoder, made by the split
            reason = check_replicable(self.model)
            if reason is not None:
                return None, reason
            why = self._room(helper.device, replica_bytes(self.model) + work)
            return (None, why) if why else (None, None)
        patcher = helper.patcher
        # DynamicVRAM streams the clone's weights; else what is not loaded there yet
        weights = 0 if is_dynamic(patcher) else \
            max(0, replica_bytes(patcher.model) - models.loaded_bytes(patcher))
        why = self._room(helper.device, weights + work, patcher)
        if why is not None:
            return None, why
        memory = work
        if self.memory_for is not None:
            memory = int(self.memory_for(tuple(z_BCTHW.shape), _decode_dtype(self.model)))
        try:
            models.load([patcher], memory)  # ComfyUI loads its clone on the helper
        except Exception as exc:  # an OOM or a core refusal leaves this helper out
            return None, f"ComfyUI could not load the VAE clone on {helper.device} ({exc})"
        model = patcher.model
        if type(model) is not type(self.model) or \
                _decode_dtype(model) != _decode_dtype(self.model):
            return None, (f"ComfyUI's clone on {helper.device} is a {type(model).__name__} in "
                          f"{_decode_dtype(model)}, the root's a {type(self.model).__name__} in "
                          f"{_decode_dtype(self.model)}")
        return model, None

    def plan(self, z_BCTHW: torch.Tensor) -> tuple[list[DeviceShare], list[str]]:
        """The shares for this latent (root first), and the reasons helpers were left out.

        One share means: decode on the root with the model's own loop.
        """
        root = z_BCTHW.device
        solo = [DeviceShare(root, (0, 0), self.model)]
        reason = check_splittable(self.model)
        if reason is not None:
            return solo, [reason]
        _, windows = self.model._decode_temporal_chunks(z_BCTHW.shape[2])  # the model's count
        solo[0].windows = (0, windows)
        if windows < self.config.min_windows:
            return solo, [f"{windows} window(s): nothing to share"]
        if not self.helpers:
            return solo, ["no other GPU"]
        height, width = (z_BCTHW.shape[-2] * self.model.vae_ratio,
                         z_BCTHW.shape[-1] * self.model.vae_ratio)
        element = z_BCTHW.element_size()
        work = (sizing.window_workspace_bytes(width, height, element)
                + sizing.split_extra_bytes(width, height, element))
        weights = self.config.shares
        if weights is not None and len(weights) != len(self.helpers) + 1:
            raise ValueError(f"decode shares {weights} give {len(weights)} speeds for "
                             f"{len(self.helpers) + 1} devices ({root} and {len(self.helpers)} "
                             f"helpers)")
        used, models, speeds, starts, notes = [root], [self.model], [1.0], [0.0], []
        copy_bytes = replica_bytes(self.model)
        for k, helper in enumerate(self.helpers):
            model, why = self._helper_model(helper, z_BCTHW, work)
            if why is not None:
                notes.append(why)
                continue
            used.append(helper.device)
            models.append(model)
            speeds.append(weights[k + 1] / weights[0] if weights else 1.0)
            copying = model is None and helper.device.type == "cuda"
            link = COPY_GBS["peer" if _peer(root, helper.device) else "host"]
            starts.append(copy_bytes / (link * sizing.GB) if copying else 0.0)
        if len(used) == 1:
            return solo, notes
        per_window = sizing.seconds_per_window(width, height, sizing.MEASURED_MATMUL_TFLOPS)
        ranges = assign_windows(windows, [per_window / s for s in speeds], starts)
        shares = [DeviceShare(d, r, m) for d, r, m in zip(used, ranges, models, strict=True)]
        return shares, notes

    # --- the patched method -----------------------------------------------------------------

    def __call__(self, z: torch.Tensor, output_buffer: torch.Tensor | None = None) -> torch.Tensor:
        model = self.model
        self.calls += 1
        shares, notes = self.plan(z)
        if len(shares) == 1:
            self.last_line = "one GPU: " + "; ".join(notes)
            self.last_report = None
            return type(model).decode_temporal(model, z, output_buffer)
        if output_buffer is None:  # as the model does: the output lives on ComfyUI's side
            output_buffer = torch.empty(model.decode_output_shape(z.shape), dtype=torch.float32,
                                        device=models.intermediate_device())
        run = SplitDecode(model, WindowLayout.from_model(model), shares, output=output_buffer,
                          progress=models.progress_bar(shares[-1].windows[1]),
                          check_interrupt=interrupts.raise_if_interrupted)
        try:
            report = run.run(z)
        except NotFollowed as exc:  # an unknown window loop: its own loop, on the root
            log.warning("H3 multi-GPU decode: %s; decoding on %s alone", exc, z.device)
            self.last_line = f"one GPU: NOT ACTIVE for this VAE: {exc}"
            self.last_report = None
            return type(model).decode_temporal(model, z, output_buffer)
        self.split_calls += 1
        self.last_report = report
        self.last_line = report.describe() + (f" ({'; '.join(notes)})" if notes else "")
        if not report.same_tile_batches:
            log.warning("H3 multi-GPU decode: the GPUs decoded with different tile batches "
                        "(free memory differed: %s); the video may differ from a one-GPU decode "
                        "in the last bits", sorted(set(report.tile_batches.values())))
            self.last_line += "; NOT exact: tile batches differed between GPUs"
        return output_buffer


def _peer(a: torch.device, b: torch.device) -> bool:
    if a.type != "cuda" or b.type != "cuda":
        return True
    return bool(torch.cuda.can_device_access_peer(a, b))


def find_patch(vae: Any) -> MultiGPUDecode | None:
    """Our patch on a VAE clone, if any."""
    patcher = getattr(vae, "patcher", None)
    patch = protocol.object_patches(patcher).get(PATCH_NAME) if patcher is not None else None
    return patch if isinstance(patch, MultiGPUDecode) else None


def install(vae: Any, patch: MultiGPUDecode) -> Any:
    """A copy of the VAE wrapper with a clone of its patcher carrying `patch` (VAE has no
    clone(): this is what Select VAE Device does too); the loader's object is never touched."""
    clone = copy.copy(vae)
    clone.patcher = vae.patcher.clone()
    protocol.install(clone.patcher, "decode", protocol.object_patch(PATCH_NAME, patch))
    return clone


def _helper_source(config: MultiGPUDecodeConfig, dynamic: bool) -> HelperCopy:
    mode = HelperCopy(config.helper_copy)
    if mode is HelperCopy.AUTO:
        return HelperCopy.COMFY if dynamic else HelperCopy.COPY
    return mode


def apply_multi_gpu_decode(vae: Any, config: MultiGPUDecodeConfig | None = None
                           ) -> tuple[Any, str]:
    """A clone of `vae` whose video decode shares its windows between GPUs, and a status line.

    A VAE that is not the windowed H3 video VAE, or that no helper can decode faithfully,
    comes back unchanged, with the reason.
    """
    config = config or MultiGPUDecodeConfig()
    model = getattr(vae, "first_stage_model", None)
    if model is None or not callable(getattr(type(model), PATCH_NAME, None)):
        return vae, ("NOT ACTIVE: this VAE has no windowed video decode "
                     f"({type(model).__name__ if model is not None else 'no model'})")
    if getattr(getattr(vae, "patcher", None), "model", None) is not model:
        return vae, "NOT ACTIVE: the VAE's patcher does not hold its first_stage_model"
    reason = check_splittable(model)
    if reason is not None:
        return vae, f"NOT ACTIVE: {reason}"
    try:
        layout = WindowLayout.from_model(model)
    except ValueError as exc:
        return vae, f"NOT ACTIVE: {exc}"
    root = getattr(vae, "device", None)
    root = torch.device(root) if root is not None else torch.device("cpu")
    try:
        devices = _helper_devices(config, root)
    except ValueError as exc:
        return vae, f"NOT ACTIVE: {exc}"
    dynamic = is_dynamic(vae.patcher)
    source = _helper_source(config, dynamic)
    if source is HelperCopy.COPY:
        if dynamic:
            return vae, ("NOT ACTIVE: helper_copy='copy' under DynamicVRAM: the VAE's weights "
                         "are VBAR-managed and are not copied module by module; use 'auto' "
                         "(ComfyUI's multi-GPU clone)")
        reason = check_replicable(model)
        if reason is not None:
            return vae, f"NOT ACTIVE: {reason}"
        helpers = [Helper(d) for d in devices]
        origin = "a copy of the root's loaded decoder (DynamicVRAM off)"
    else:
        try:  # before our patch exists: the clones carry the loader's patches, not ours
            helpers = [Helper(d, comfy_clone(vae.patcher, d)) for d in devices]
        except CloneMissing as exc:
            why = "under DynamicVRAM " if dynamic else ""
            return vae, (f"NOT ACTIVE: {why}a helper's decoder must be ComfyUI's multi-GPU "
                         f"clone, and {exc}")
        origin = ("ComfyUI's multi-GPU clone (deepclone_multigpu), loaded on the helper by "
                  "ComfyUI" + (" under DynamicVRAM" if dynamic else ""))
    patch = MultiGPUDecode(model, config, helpers, getattr(vae, "memory_used_decode", None))
    clone = install(vae, patch)
    if not devices:
        return clone, f"on, but one GPU: {root} is the only device (the model's own loop runs)"
    names = ", ".join(str(d) for d in devices)
    weights = ":".join(f"{s:g}" for s in config.shares) if config.shares else "equal"
    return clone, (f"on: windows shared between {root} (root) and {names}, {weights} shares, "
                   f"cut at window starts (every {layout.stride} latent frames); each GPU runs "
                   f"the VAE's own decode_temporal on its windows ({release_shape(model)}); "
                   f"helper decoder: {origin}; exact (each cut's cross-fade is the model's own "
                   f"blend, elementwise)")
