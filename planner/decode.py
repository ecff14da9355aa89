"""The video decode phase: its memory and time from measurements, and whether to split it.

The VAE's GPU decodes alone unless a helper GPU can take a copy of the decoder beside what it
still holds at decode time (the DiT's resident weights, unless ComfyUI unloads them to make
room), and the split saves time. Numbers come from `decode.sizing` (measured on an H200);
windows are shared by each GPU's GEMM rate, the helpers starting after their decoder copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decode import sizing
from ..decode.sizing import WindowLayout, assign_windows, finish_seconds, frames_to_latents
from .hardware import GB, GiB, HardwareProfile

MIN_GAIN = 1.05  # split only when it is at least this much faster
DECODER_FRACTION = sizing.DECODER_PARAMS / (sizing.MEASURED_WEIGHT_BYTES / 2)  # of the VAE file


@dataclass(frozen=True)
class DecodePlan:
    devices: tuple[int, ...]  # the VAE's GPU first, then helpers that take windows
    windows: tuple[tuple[int, int], ...]  # window range per device
    seconds: float  # predicted wall time of the video decode
    single_seconds: float  # on the VAE's GPU alone (ComfyUI's path)
    # per GPU during the decode: (weights, activations) of the decode itself (the VAE or its
    # decoder copy; windows, latent, frames in flight), not what other models keep there
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)
    make_room: bool = False  # a helper needs ComfyUI to unload the DiT there first
    reason: str = ""

    @property
    def multi(self) -> bool:
        return len(self.devices) > 1

    @property
    def peak_bytes(self) -> dict[int, int]:
        return {g: w + a for g, (w, a) in self.memory.items()}

    def describe(self) -> str:
        if not self.multi:
            return f"one GPU (gpu:{self.devices[0]}): {self.reason}"
        parts = ", ".join(f"gpu:{d} windows {a}-{b - 1}"
                          for d, (a, b) in zip(self.devices, self.windows, strict=True))
        return (f"{len(self.devices)} GPUs ({parts}): {self.seconds:.1f} s instead of "
                f"{self.single_seconds:.1f} s -- {self.reason}")


def decode_memory(width: int, height: int, frames: int, vae_bytes: int,
                  element_bytes: int = 2) -> dict[str, tuple[int, int]]:
    """(weights, activations) of the decode on the VAE's GPU alone ("alone"), on it in a split
    ("root") and on a helper in a split ("helper"). Measured: 5.5 GiB at 1312x736 alone."""
    latents = frames_to_latents(frames)
    work = sizing.window_workspace_bytes(width, height, element_bytes)
    extra = sizing.split_extra_bytes(width, height, element_bytes)
    latent = sizing.latent_bytes(width, height, latents, element_bytes)
    return {"alone": (vae_bytes, work + latent), "root": (vae_bytes, work + latent + extra),
            "helper": (int(vae_bytes * DECODER_FRACTION), work + extra)}


def plan_decode(profile: HardwareProfile, *, vae_gpu: int, helpers: list[int], width: int,
                height: int, frames: int, vae_bytes: int, usable_bytes: dict[int, int],
                held_bytes: dict[int, int], reload_bytes: dict[int, int] | None = None,
                mode: str = "auto", element_bytes: int = 2) -> DecodePlan:
    """Decide the decode's devices.

    usable_bytes[g]: capacity minus the reserve; held_bytes[g]: what other models keep on g at
    decode time (the DiT's resident weights); reload_bytes[g]: what ComfyUI would have to load
    again later if it unloaded them (the cost of making room).
    """
    layout = WindowLayout()
    _, windows = layout.windows(frames_to_latents(frames))
    memory = decode_memory(width, height, frames, vae_bytes, element_bytes)
    helper_need = sum(memory["helper"])
    gpus = profile.gpus
    per_window = {g: sizing.seconds_per_window(width, height, gpus[g].matmul_tflops)
                  for g in [vae_gpu, *helpers]}
    single = windows * per_window[vae_gpu]

    def solo(reason: str) -> DecodePlan:
        return DecodePlan((vae_gpu,), ((0, windows),), single, single,
                          {vae_gpu: memory["alone"]}, reason=reason)

    if mode == "off":
        return solo("switched off")
    if not helpers:
        return solo("no other GPU")
    if windows < 2:
        return solo(f"{frames} frames are one decoder window")
    used, notes, make_room = [vae_gpu], [], False
    for g in helpers:
        free = usable_bytes[g] - held_bytes.get(g, 0)
        if helper_need <= free:
            notes.append(f"gpu:{g} has room beside what it holds for a decoder copy and its "
                         f"windows ({helper_need / GiB:.1f} GiB)")
            used.append(g)
        elif helper_need <= usable_bytes[g]:
            reload = (reload_bytes or {}).get(g, held_bytes.get(g, 0))
            reload_s = reload / (profile.link.host_pinned_gbs * GB)
            notes.append(f"ComfyUI unloads {held_bytes.get(g, 0) / GiB:.1f} GiB from gpu:{g} "
                         f"for the decoder copy (reloaded later in ~{reload_s:.1f} s)")
            used.append(g)
            make_room = True
        else:
            notes.append(f"gpu:{g} has {usable_bytes[g] / GiB:.1f} GiB usable, a decoder copy "
                         f"and its windows need {helper_need / GiB:.1f} GiB")
    if len(used) == 1:
        return solo("; ".join(notes))
    copy_s = helper_need / (profile.link.helper_gbs * GB)
    starts = [0.0] + [copy_s] * (len(used) - 1)
    ranges = assign_windows(windows, [per_window[g] for g in used], starts)
    kept = [(g, r) for g, r in zip(used, ranges, strict=True) if r[1] > r[0]]
    seconds = finish_seconds([r for _, r in kept], [per_window[g] for g, _ in kept],
                             [0.0] + [copy_s] * (len(kept) - 1))
    if mode != "on" and single / seconds < MIN_GAIN:
        return solo(f"sharing {windows} windows would be only {single / seconds:.2f}x faster")
    peaks = {vae_gpu: memory["root"]}
    peaks.update({g: memory["helper"] for g, _ in kept[1:]})
    piece_mb = sizing.boundary_piece_bytes(width, height, element_bytes) / 1e6
    reason = (f"{single / seconds:.2f}x; windows cut every 5 latent frames, one 5-frame "
              f"cross-fade piece ({piece_mb:.0f} MB) handed over per cut instead of decoding a "
              f"window twice; " + "; ".join(notes))
    return DecodePlan(tuple(g for g, _ in kept), tuple(r for _, r in kept), seconds, single,
                      peaks, make_room, reason)
