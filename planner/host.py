"""Host RAM: what the job keeps in host memory against what this host (or its container) allows.

The rule, checked with the verdict before anything is loaded: the job's host-resident bytes
must fit in the host's memory, capped by a cgroup memory limit where one is set (a container,
a systemd slice). What the job keeps in host memory, per component (an estimate, each part
stated in the report):
- the DiT's host copy: under ComfyUI's DynamicVRAM the whole DiT (comfy-aimdo casts each layer
  in from host memory); on the legacy loader the blocks the pack's streamer streams (their host
  copies), nothing when every block is resident;
- the text encoder, the VAEs and the latent upscaler: ComfyUI offloads each to host memory
  once it ran (a GPU it shares with the next model needs the room);
- the LoRA's tensors (kept as weight patches);
- the decoded video: ComfyUI's IMAGE is float32 frames on the CPU (4 bytes x 3 channels);
- ComfyUI, torch and the CUDA/ROCm runtime themselves: `RUNTIME_BYTES`.
The pinned part (ComfyUI's pin budget and the pack's pins within it) is inside these bytes, not
on top: page locking changes how host memory is used, not how much.

Where the limit comes from (`host_memory_limit`): the physical RAM (psutil, else sysconf), then
a cgroup v2 `memory.max` or a v1 `memory.limit_in_bytes` of this process when smaller (Linux).
Windows and macOS: psutil only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .hardware import GiB

RUNTIME_BYTES = 3 * GiB  # ComfyUI + torch + the GPU runtime's host side, measured ~2.5-3 GiB
IMAGE_BYTES_PER_PIXEL = 3 * 4  # ComfyUI's IMAGE: float32 RGB
_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def _physical_bytes() -> tuple[int | None, str]:
    try:
        import psutil  # a ComfyUI requirement; optional for the planner

        return int(psutil.virtual_memory().total), "physical RAM (psutil)"
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"
    except (AttributeError, ValueError, OSError):
        return None, "unknown"


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < _NO_LIMIT else None


def cgroup_limit_bytes(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, str]:
    """This process's cgroup memory limit (v2 `memory.max` of its own group, then the root's;
    v1 `memory/memory.limit_in_bytes`), or None."""
    groups = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, _, path = line.partition(":")[2].partition(":")
            if hierarchy == "":  # v2: "0::/path"
                groups.append(root / path.lstrip("/") / "memory.max")
            elif "memory" in hierarchy.split(","):
                groups.append(root / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
    except OSError:
        pass
    groups += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for path in groups:
        limit = _read_limit(path)
        if limit is not None:
            return limit, f"cgroup limit ({path})"
    return None, ""


def host_memory_limit() -> tuple[int | None, str]:
    """(bytes, where from): the physical RAM, or the cgroup limit when that is smaller."""
    physical, source = _physical_bytes()
    limit, where = cgroup_limit_bytes() if os.name == "posix" else (None, "")
    if limit is not None and (physical is None or limit < physical):
        return limit, where
    return physical, source


@dataclass(frozen=True)
class HostMemoryPlan:
    """The job's host-resident bytes against the host's limit."""

    available_bytes: int
    source: str  # where the limit comes from, in words
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def needed_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        parts = ", ".join(f"{name} {n / GiB:.1f}" for name, n in self.parts.items() if n)
        state = "" if self.fits else ": DOES NOT FIT"
        return (f"needs {self.needed_bytes / GiB:.1f} GiB of {self.available_bytes / GiB:.1f} "
                f"GiB ({self.source}){state} -- {parts}")

    def problem(self) -> str:
        """The verdict's line: needed vs available, and what to change."""
        short = (self.needed_bytes - self.available_bytes) / GiB
        biggest = max(self.parts, key=self.parts.get)
        return (f"host RAM: the job keeps {self.needed_bytes / GiB:.1f} GiB in host memory but "
                f"{self.available_bytes / GiB:.1f} GiB are available ({self.source}), "
                f"{short:.1f} GiB short (largest part: {biggest}); raise the container's memory "
                "limit or use a host with more RAM, or keep more of the DiT on the GPUs "
                "(legacy loader, more resident blocks), a shorter clip or the INT8 DiT")


def plan_host_memory(*, sizes, loader, prefetch, frames: int, width: int, height: int,
                     available_bytes: int, source: str) -> HostMemoryPlan:
    """The job's host-resident bytes (see the module docstring) against `available_bytes`."""
    block = sizes.dit_block_bytes
    if loader is not None and loader.dynamic:
        dit = sizes.dit_bytes
    else:
        streamed = prefetch.streamed_blocks + (prefetch.streamed_refiner_blocks
                                               if prefetch.streamed_blocks else 0)
        dit = streamed * block
    parts = {
        "DiT host copy": dit,
        "text encoder": sizes.text_encoder_bytes,
        "VAEs and upscaler": sizes.vae_bytes + sizes.upscaler_bytes,
        "LoRA": sizes.lora_bytes,
        "decoded video": frames * width * height * IMAGE_BYTES_PER_PIXEL,
        "ComfyUI and torch": RUNTIME_BYTES,
    }
    return HostMemoryPlan(available_bytes=int(available_bytes), source=source, parts=parts)
