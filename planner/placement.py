"""Stage 2 of a plan: which GPU runs what.

With two or more GPUs, GPU0 (the "helper") hosts the text encoder, both VAEs and the latent
upscaler, and the DiT with its sampler gets GPU1 (the "root"): the root keeps every byte for the
DiT's weights and activations, and the helper's other work fits beside its share of a split
step. With one GPU everything shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .components import ComponentSizes
from .hardware import GiB, HardwareProfile

COMPONENTS = ("text_encoder", "video_vae", "audio_vae", "latent_upscaler", "dit", "sampler")


def reserve_bytes(capacity: int) -> int:
    """Kept free on every GPU: allocator fragmentation and the runtime's own context."""
    return int(0.4 * GiB + 0.04 * capacity)


@dataclass(frozen=True, kw_only=True)
class Placement:
    root: int  # the DiT's GPU
    helpers: tuple[int, ...]  # the other GPUs, the first hosting the text encoder, VAEs, upscaler
    components: dict[str, int]  # component -> GPU index
    usable_bytes: dict[int, int]  # capacity less the reserve, per GPU
    # what the first helper has left for a split step's DiT and activations beside the VAEs and
    # the upscaler, which ComfyUI keeps loaded there between the passes (0 with one GPU)
    helper_free_bytes: int

    @property
    def multi(self) -> bool:
        return bool(self.helpers)

    def role(self, index: int) -> str:
        if index == self.root:
            return "root" if self.helpers else "root+helper"
        return "helper"


def place(*, profile: HardwareProfile, sizes: ComponentSizes) -> Placement:
    multi = profile.gpu_count >= 2
    root = 1 if multi else 0
    helpers = tuple(i for i in range(profile.gpu_count) if i != root)
    side = helpers[0] if multi else root
    components = {name: (root if name in ("dit", "sampler") else side) for name in COMPONENTS}
    usable = {i: g.memory_bytes - reserve_bytes(g.memory_bytes)
              for i, g in enumerate(profile.gpus)}
    helper_free = usable[side] - sizes.vae_bytes - sizes.upscaler_bytes if multi else 0
    return Placement(root=root, helpers=helpers, components=components, usable_bytes=usable,
                     helper_free_bytes=helper_free)
