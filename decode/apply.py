"""ComfyUI seam: `MultiGPUDecodeConfig` and `apply_multi_gpu_decode(vae, config)`.

The seam is a method-level object patch on the VAE's model, `decode_temporal` (the upstream
H3 video VAE's window loop), added to a clone of the VAE's ModelPatcher. ComfyUI's own
`VAE.decode` stays in charge of everything around the window loop: loading the root copy with
its memory estimate, the single float32 output buffer it preallocates on the host (we write into
it directly), the de-normalisation of the latent, the OOM fallback and the output layout. So the
stock VAE Decode node, and every other node that decodes through this VAE, decodes on several
GPUs without a change to the graph, and ComfyUI removes the patch when it unloads the clone.
(A decode node of our own would have to copy `VAE.decode`'s envelope, which changes between
ComfyUI versions.)

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
from typing import Any

import torch

from ..dual_sage.shard_plan import parse_devices, validate_devices
from . import sizing
from .executor import DecodeReport, DeviceShare, SplitDecode
from .replica import check_replicable, replica_bytes
from .windows import WindowLayout, assign_windows, parse_weights

log = logging.getLogger("h3_multigpu")

PATCH_NAME = "decode_temporal"  # the upstream H3 video VAE's window loop
COPY_GBS = {"peer": 100.0, "host": 10.0}  # decoder copy rate for the share plan (conservative)


@dataclass
class MultiGPUDecodeConfig:
    """Share the video VAE's windows between the VAE's GPU (root) and helper GPUs.

    helpers: helper devices ("cuda:0", ...) or None for every other visible GPU.
    shares: relative speeds, root first ("1:0.7"), or None: equal.
    make_room: let ComfyUI unload models from a helper GPU when the decoder copy does not fit.
    min_windows: below this many windows the decode stays on the root.
    copy_depth: finished heads per GPU that may wait for their copy to the host.
    """

    helpers: tuple[str, ...] | None = None
    shares: tuple[float, ...] | None = None
    make_room: bool = True
    min_windows: int = 2
    copy_depth: int = 1

    def __post_init__(self) -> None:
        if self.min_windows < 2:
            raise ValueError(f"min_windows={self.min_windows}: sharing needs at least 2 windows")
        if self.copy_depth < 1:
            raise ValueError(f"copy_depth={self.copy_depth} must be at least 1")
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


def _comfy_mm():
    try:
        import comfy.model_management as mm
    except ImportError:
        return None
    return mm


def _helper_devices(config: MultiGPUDecodeConfig, root: torch.device) -> list[torch.device]:
    if config.helpers is not None:
        devices = list(parse_devices(",".join(config.helpers)) or ())
        validate_devices(root, devices)
        return devices
    if root.type != "cuda" or not torch.cuda.is_available():
        return []
    index = root.index if root.index is not None else torch.cuda.current_device()
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count()) if i != index]


class MultiGPUDecode:
    """The object patched in for the model's `decode_temporal(z, output_buffer=None)`."""

    def __init__(self, model: torch.nn.Module, config: MultiGPUDecodeConfig) -> None:
        self.model = model
        self.config = config
        self.calls = 0  # decodes that went through the patch
        self.split_calls = 0  # of which shared between devices
        self.last_report: DecodeReport | None = None
        self.last_line = "not run yet"

    # --- planning a call --------------------------------------------------------------------

    def _helper_fits(self, device: torch.device, need: int) -> str | None:
        """None when `device` can take a decoder copy now, else why not."""
        mm = _comfy_mm()
        if device.type != "cuda" or mm is None:
            return None
        free = mm.get_free_memory(device)
        if free < need and self.config.make_room:
            mm.free_memory(need, device)  # ComfyUI unloads models there, as for any load
            free = mm.get_free_memory(device)
        if free < need:
            return (f"{device} has {free / sizing.GiB:.1f} GiB free, a decoder copy and its "
                    f"windows need {need / sizing.GiB:.1f} GiB")
        return None

    def plan(self, z_BCTHW: torch.Tensor) -> tuple[list[DeviceShare], list[str]]:
        """The shares for this latent (root first), and the reasons helpers were left out.

        One share means: decode on the root with the model's own loop.
        """
        root = z_BCTHW.device
        solo = [DeviceShare(root, (0, 0), self.model)]
        reason = check_replicable(self.model)
        if reason is not None:
            return solo, [reason]
        layout = WindowLayout.from_model(self.model)
        _, windows = layout.windows(z_BCTHW.shape[2])
        solo[0].windows = (0, windows)
        if windows < self.config.min_windows:
            return solo, [f"{windows} window(s): nothing to share"]
        helpers = _helper_devices(self.config, root)
        if not helpers:
            return solo, ["no other GPU"]
        height, width = (z_BCTHW.shape[-2] * self.model.vae_ratio,
                         z_BCTHW.shape[-1] * self.model.vae_ratio)
        element = z_BCTHW.element_size()
        copy_bytes = replica_bytes(self.model)
        need = (copy_bytes + sizing.window_workspace_bytes(width, height, element)
                + sizing.split_extra_bytes(width, height, element))
        used, speeds, notes = [root], [1.0], []
        weights = self.config.shares
        if weights is not None and len(weights) != len(helpers) + 1:
            raise ValueError(f"decode shares {weights} give {len(weights)} speeds for "
                             f"{len(helpers) + 1} devices ({root} and {len(helpers)} helpers)")
        for k, device in enumerate(helpers):
            why = self._helper_fits(device, need)
            if why is not None:
                notes.append(why)
                continue
            used.append(device)
            speeds.append(weights[k + 1] / weights[0] if weights else 1.0)
        if len(used) == 1:
            return solo, notes
        per_window = sizing.seconds_per_window(width, height, sizing.MEASURED_MATMUL_TFLOPS)
        starts = [0.0] + [copy_bytes / (COPY_GBS["peer" if _peer(root, d) else "host"]
                                        * sizing.GB) if d.type == "cuda" else 0.0
                          for d in used[1:]]
        ranges = assign_windows(windows, [per_window / s for s in speeds], starts)
        shares = [DeviceShare(d, r, self.model if d is root else None)
                  for d, r in zip(used, ranges, strict=True)]
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
        if output_buffer is None:  # as the model does: the output lives on ComfyUI's host side
            mm = _comfy_mm()
            where = mm.intermediate_device() if mm is not None else torch.device("cpu")
            output_buffer = torch.empty(model.decode_output_shape(z.shape), dtype=torch.float32,
                                        device=where)
        layout = WindowLayout.from_model(model)
        progress, interrupt = _comfy_progress(layout.windows(z.shape[2])[1])
        run = SplitDecode(model, layout, shares, output=output_buffer, progress=progress,
                          check_interrupt=interrupt, copy_depth=self.config.copy_depth)
        report = run.run(z)
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


def _comfy_progress(windows: int):
    """ComfyUI's progress bar (one step per window) and interrupt check, when importable."""
    try:
        import comfy.utils

        bar = comfy.utils.ProgressBar(windows)
        progress = bar.update
    except ImportError:
        progress = None
    mm = _comfy_mm()
    return progress, (mm.throw_exception_if_processing_interrupted if mm is not None else None)


def find_patch(vae: Any) -> MultiGPUDecode | None:
    """Our patch on a VAE clone, if any."""
    patches = getattr(getattr(vae, "patcher", None), "object_patches", {}) or {}
    patch = patches.get(PATCH_NAME)
    return patch if isinstance(patch, MultiGPUDecode) else None


def apply_multi_gpu_decode(vae: Any, config: MultiGPUDecodeConfig | None = None
                           ) -> tuple[Any, str]:
    """A clone of `vae` whose video decode shares its windows between GPUs, and a status line.

    A VAE that is not the windowed H3 video VAE comes back unchanged, with the reason.
    """
    config = config or MultiGPUDecodeConfig()
    model = getattr(vae, "first_stage_model", None)
    if model is None or not callable(getattr(type(model), PATCH_NAME, None)):
        return vae, ("NOT ACTIVE: this VAE has no windowed video decode "
                     f"({type(model).__name__ if model is not None else 'no model'})")
    if getattr(getattr(vae, "patcher", None), "model", None) is not model:
        return vae, "NOT ACTIVE: the VAE's patcher does not hold its first_stage_model"
    try:
        WindowLayout.from_model(model)
    except ValueError as exc:
        return vae, f"NOT ACTIVE: {exc}"
    reason = check_replicable(model)
    if reason is not None:
        return vae, f"NOT ACTIVE: {reason}"
    clone = copy.copy(vae)  # VAE has no clone(); never mutate the loader's object
    clone.patcher = vae.patcher.clone()
    patch = MultiGPUDecode(model, config)
    clone.patcher.add_object_patch(PATCH_NAME, patch)
    root = getattr(vae, "device", None)
    root = torch.device(root) if root is not None else torch.device("cpu")
    try:
        helpers = _helper_devices(config, root)
    except ValueError as exc:
        return vae, f"NOT ACTIVE: {exc}"
    if not helpers:
        return clone, f"on, but one GPU: {root} is the only device (the model's own loop runs)"
    names = ", ".join(str(d) for d in helpers)
    weights = ":".join(f"{s:g}" for s in config.shares) if config.shares else "equal"
    return clone, (f"on: windows shared between {root} (root) and {names}, {weights} shares, "
                   f"cut every 5 latent frames; exact (each GPU runs the model's own windows, "
                   f"the cross-fades are elementwise)")
