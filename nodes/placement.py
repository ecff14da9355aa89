"""Where each component of the H3 job runs: pure decisions, no ComfyUI.

The layout the pack is built around (ARCHITECTURE.md): the DiT and both sampling passes on the
"root" GPU (gpu:1 on a pair), everything that runs once or between passes on the "helper"
(gpu:0): text encoder, video and audio VAE, latent upscaler, and the Dual-Sage helper heads.
A plan may choose other indices; a machine with fewer GPUs than the plan degrades to one GPU
and says so instead of failing or silently doing nothing. `comfy_placement.py` carries the
decision out through ComfyUI's own device selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import GiB, GpuInfo, describe_index

# Components that live on the helper GPU, in the order the job uses them.
HELPER_COMPONENTS = ("text_encoder", "video_vae", "audio_vae", "latent_upscaler")
ROOT_COMPONENTS = ("dit",)


@dataclass(frozen=True)
class Placement:
    """Resolved GPU indices (None = no GPU, ComfyUI's default CPU path)."""

    root: int | None
    helper: int | None
    gpus: tuple[GpuInfo, ...]
    notes: tuple[str, ...] = field(default=())  # degradations, in words

    @property
    def multi_gpu(self) -> bool:
        return self.root is not None and self.helper is not None and self.root != self.helper

    @property
    def degraded(self) -> bool:
        return bool(self.notes)

    def device_of(self, component: str) -> int | None:
        if component in ROOT_COMPONENTS:
            return self.root
        if component in HELPER_COMPONENTS:
            return self.helper
        raise ValueError(f"unknown component {component!r}; one of "
                         f"{ROOT_COMPONENTS + HELPER_COMPONENTS}")

    def lines(self) -> list[str]:
        """'DiT (root): gpu:1 NVIDIA ... 32 GiB' and the helper line, for the status."""
        root = describe_index(self.root, list(self.gpus))
        helper = describe_index(self.helper, list(self.gpus))
        if not self.multi_gpu:
            return [f"one device for everything: {root}"]
        return [
            f"DiT + sampler (root): {root}",
            f"text encoder, video/audio VAE, latent upscaler (helper): {helper}",
        ]


def decide_placement(
    gpus: list[GpuInfo],
    *,
    root: int | None = None,
    helper: int | None = None,
) -> Placement:
    """Resolve root/helper GPU indices against the GPUs present.

    `root`/`helper` come from a plan or the user; None means the default (root gpu:1,
    helper gpu:0 on two or more GPUs). Indices past the machine's GPUs and a missing second
    GPU degrade to what exists, with a note naming what was asked and what runs instead.
    """
    notes: list[str] = []
    count = len(gpus)
    if count == 0:
        return Placement(None, None, (), ("no GPU found: ComfyUI's default devices are used",))
    want_root = 1 if root is None else root
    want_helper = 0 if helper is None else helper
    if count == 1:
        if want_root != 0 or want_helper != 0:
            notes.append(
                f"only one GPU ({gpus[0].describe()}): the plan's split (root gpu:{want_root}, "
                f"helper gpu:{want_helper}) runs on gpu:0 alone; Dual-Sage is off"
            )
        return Placement(0, 0, tuple(gpus), tuple(notes))
    if not 0 <= want_root < count:
        notes.append(f"root gpu:{want_root} does not exist ({count} GPUs): using gpu:1")
        want_root = 1
    if not 0 <= want_helper < count:
        notes.append(f"helper gpu:{want_helper} does not exist ({count} GPUs): using gpu:0")
        want_helper = 0
    if want_root == want_helper:
        other = 0 if want_root != 0 else 1
        notes.append(f"root and helper were both gpu:{want_root}: helper moved to gpu:{other}")
        want_helper = other
    return Placement(want_root, want_helper, tuple(gpus), tuple(notes))


def placement_from_plan(plan, gpus: list[GpuInfo]) -> Placement:
    """The plan's root and first helper, checked against this machine's GPUs."""
    if plan is None:
        return decide_placement(gpus)
    helpers = list(getattr(plan, "helper_devices", []) or [])
    root = getattr(plan, "root_device", None)
    helper = helpers[0] if helpers else (root if root is not None else None)
    if root is not None and helper == root and len(gpus) >= 2:
        # A single-GPU plan on a multi-GPU machine: honour it, one device for everything.
        return Placement(root, root, tuple(gpus),
                         (f"the plan uses one GPU (gpu:{root}) although {len(gpus)} are present",))
    return decide_placement(gpus, root=root, helper=helper)


def should_release_text_encoder(mode: str, plan=None, placement: Placement | None = None
                                ) -> tuple[bool, str]:
    """Whether to unload the text encoder once the prompt is encoded, and why.

    mode "always" / "never" decide directly. "auto": release when the DiT shares the text
    encoder's GPU (it needs every byte for PASS2), when there is no plan to prove the room,
    or when the helper GPU cannot hold the text encoder beside its largest later phase
    (Dual-Sage heads, latent upscale, decode) as the plan predicts them.
    """
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"release mode {mode!r} is not valid; use 'auto', 'always' or 'never'")
    if mode == "always":
        return True, "release requested"
    if mode == "never":
        return False, "kept loaded (release set to never)"
    if placement is not None and placement.root is None:
        return False, "no GPU on this server: left to ComfyUI (the pack is not active)"
    if placement is not None and not placement.multi_gpu:
        return True, "the DiT shares its GPU: the text encoder leaves after encoding"
    if plan is None:
        return True, "no plan to prove the room: released to be safe"
    helper_index = placement.helper if placement is not None else (
        (getattr(plan, "helper_devices", None) or [0])[0])
    gpu_plan = next((g for g in getattr(plan, "gpus", []) if g.index == helper_index), None)
    sizes = getattr(plan, "sizes", None)
    te_bytes = getattr(sizes, "text_encoder_bytes", None)
    if gpu_plan is None or te_bytes is None:
        return True, "plan has no helper memory figures: released to be safe"
    later = [p.peak for name, p in gpu_plan.phases.items() if name != "text encode"]
    need = te_bytes + max(later, default=0)
    room = gpu_plan.capacity_bytes - gpu_plan.reserve_bytes
    if need > room:
        return True, (f"helper gpu:{helper_index} needs {need / GiB:.1f} GiB with the text "
                      f"encoder kept, has {room / GiB:.1f} GiB: released after encoding")
    return False, (f"kept on gpu:{helper_index}: {need / GiB:.1f} of {room / GiB:.1f} GiB "
                   f"with it loaded (the next prompt encodes without reloading)")
