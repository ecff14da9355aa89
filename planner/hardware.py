"""Device inventory: built-in hardware profiles and the real machine.

A profile is data: per GPU its memory and the throughputs the time model needs, and the link
between the GPUs (peer access or not, bandwidths). Throughputs are *effective* rates for H3's
shapes (dense bf16/fp16 GEMMs, SDPA at 128-wide heads), not datasheet peaks: the H200 numbers are
our own measurements (`shared/reference/h200x2-anchors.json`); the consumer cards are scaled from
their datasheet dense tensor rates by the same efficiency and are leads until measured.

No torch import at module level: `detect_hardware()` imports it lazily so the planner runs on a
machine with no GPU and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GiB = 1024**3
GB = 1000**3


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    matmul_tflops: float  # effective dense GEMM rate in the compute dtype
    attention_tflops: float  # effective bf16/fp16 SDPA rate at 128-wide heads
    int8_attention_tflops: float  # effective rate of a quantized (INT8 QK) attention kernel
    memory_bandwidth_gbs: float
    compute_dtype: str = "bf16"  # fp16 on cards without bf16 (V100)
    backend: str = "cuda"  # "cuda" or "rocm"

    def describe(self) -> str:
        return f"{self.name} {self.memory_bytes / GiB:.0f} GiB"


@dataclass(frozen=True)
class LinkSpec:
    kind: str  # "nvlink", "pcie4 x8", ...
    peer_access: bool
    peer_gbs: float  # GPU<->GPU with peer access (0 without)
    host_pinned_gbs: float  # pinned host -> GPU
    host_pageable_gbs: float  # pageable host -> GPU (through a driver bounce buffer)

    @property
    def helper_gbs(self) -> float:
        """Bandwidth a head shard travels at: peer copy, or a pinned host relay (two hops)."""
        if self.peer_access:
            return self.peer_gbs
        # device -> pinned host -> device, chunked and overlapped: both hops share the bus
        return self.host_pinned_gbs / 2.0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpus: tuple[GPUSpec, ...]
    link: LinkSpec
    host_ram_bytes: int
    measured: bool = False  # True when read off the real machine
    notes: tuple[str, ...] = field(default=())
    rocm_version: tuple[int, int] | None = None  # (major, minor) of a ROCm build of torch
    torch_version: tuple[int, int] | None = None  # None: assumed new enough (>= 2.8)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def dynamic_vram_default(self) -> tuple[bool, str]:
        """Whether ComfyUI loads with DynamicVRAM (comfy-aimdo) here when no flag says
        otherwise, and why: NVIDIA, or ROCm 7.14 and newer, with torch 2.8 or newer (the rule
        of ComfyUI's main.py, read on 0.33.0 and the newest files)."""
        if self.torch_version is not None and self.torch_version < (2, 8):
            version = ".".join(map(str, self.torch_version))
            return False, f"torch {version} is older than 2.8 (DynamicVRAM needs 2.8)"
        backends = {gpu.backend for gpu in self.gpus}
        if backends == {"cuda"}:
            return True, "NVIDIA: ComfyUI's default loader"
        if self.rocm_version is None:
            return False, "ROCm of unknown version: taken as below 7.14 (DynamicVRAM needs 7.14)"
        version = ".".join(map(str, self.rocm_version))
        if self.rocm_version >= (7, 14):
            return True, f"ROCm {version}: ComfyUI's default loader from ROCm 7.14"
        return False, f"ROCm {version} is below 7.14, where ComfyUI's DynamicVRAM starts"


def _pair(gpu: GPUSpec, link: LinkSpec, name: str, description: str, host_ram_gb: int,
          *notes: str, rocm: tuple[int, int] | None = None) -> HardwareProfile:
    return HardwareProfile(name, description, (gpu, gpu), link, host_ram_gb * GiB, notes=notes,
                           rocm_version=rocm)


_PCIE4_X8 = LinkSpec("PCIe 4.0 x8/x8, no peer access", False, 0.0, 12.0, 6.0)
_PCIE4_X8_3060 = LinkSpec("PCIe 4.0 x16/x4 (typical consumer board), no peer access", False, 0.0,
                          12.0, 6.0)
_PCIE5_X8 = LinkSpec("PCIe 5.0 x8/x8, no peer access", False, 0.0, 24.0, 10.0)

# R9700 attention rates calibrated on the user's 2x R9700 run: 10 s at 1312x736 took 72.62 s/it
# with Dual-Sage and INT8-QK attention, and BF16 attention was ~56% slower (H3_FACTS section 7)
R9700 = GPUSpec("AMD Radeon AI PRO R9700", 32 * GiB, 95.0, 49.0, 76.0, 640.0, "bf16", "rocm")
RTX3060 = GPUSpec("NVIDIA GeForce RTX 3060", 12 * GiB, 22.0, 16.0, 30.0, 360.0)
RTX5060TI = GPUSpec("NVIDIA GeForce RTX 5060 Ti", 16 * GiB, 42.0, 30.0, 55.0, 448.0)
V100 = GPUSpec("NVIDIA Tesla V100-SXM2", 32 * GiB, 95.0, 60.0, 0.0, 900.0, "fp16")
H200 = GPUSpec("NVIDIA H200", 141 * GB, 700.0, 600.0, 500.0, 4300.0)
RTX5090 = GPUSpec("NVIDIA GeForce RTX 5090", 32 * GiB, 190.0, 130.0, 240.0, 1790.0)

PROFILES: dict[str, HardwareProfile] = {
    "2xR9700": _pair(R9700, _PCIE4_X8, "2xR9700",
                     "2x Radeon AI PRO R9700 32 GB, ROCm, PCIe 4.0 x8/x8, no peer access", 128,
                     "ROCm: torch.cuda is HIP; comfy-kitchen int8 attention needs RDNA3+ WMMA.",
                     rocm=(7, 2)),  # the user's ROCm 7.2.4 (H3_FACTS section 7)
    "2x3060": _pair(RTX3060, _PCIE4_X8_3060, "2x3060", "2x GeForce RTX 3060 12 GB, no peer access",
                    64),
    "2x5060Ti": _pair(RTX5060TI, _PCIE5_X8, "2x5060Ti",
                      "2x GeForce RTX 5060 Ti 16 GB, PCIe 5.0 x8/x8, no peer access", 64),
    "2xV100": _pair(V100, LinkSpec("NVLink 2.0", True, 130.0, 12.0, 6.0), "2xV100",
                    "2x Tesla V100 32 GB, NVLink, fp16 (no bf16)", 128,
                    "V100 has no bf16: the DiT runs in fp16; no INT8 attention kernel."),
    "2xH200": _pair(H200, LinkSpec("NVLink", True, 393.0, 54.6, 18.0), "2xH200",
                    "2x H200 141 GB, NVLink (our lab machine; rates measured)", 256),
    "1x5090": HardwareProfile("1x5090", "1x GeForce RTX 5090 32 GB", (RTX5090,),
                              LinkSpec("PCIe 5.0 x16", False, 0.0, 50.0, 20.0), 64 * GiB),
}


def list_profiles() -> list[str]:
    return list(PROFILES)


def get_profile(name: str) -> HardwareProfile:
    if name in PROFILES:
        return PROFILES[name]
    lowered = {k.lower(): k for k in PROFILES}
    if name.lower() in lowered:
        return PROFILES[lowered[name.lower()]]
    raise ValueError(
        f"unknown hardware profile {name!r}; use one of {', '.join(PROFILES)} or 'auto' "
        f"for the GPUs of this machine"
    )


def _closest_spec(name: str) -> GPUSpec | None:
    lowered = name.lower()
    for spec in (H200, R9700, RTX5090, RTX5060TI, RTX3060, V100):
        key = spec.name.lower().split()[-1]
        if key in lowered:
            return spec
    return None


def detect_hardware(measure_link: bool = False) -> HardwareProfile:
    """The real machine's GPUs (torch.cuda, CUDA or ROCm) as a profile.

    Memory and names are read; throughputs come from the closest built-in card (or a
    conservative default). With `measure_link`, host->GPU and GPU->GPU bandwidths are measured
    with 256 MiB copies (a second or two).
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise ValueError("--gpus auto needs PyTorch; use --profile NAME instead") from exc
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise ValueError(
            "no CUDA/ROCm GPU is visible to PyTorch; use a built-in profile instead "
            f"(--profile {' | '.join(PROFILES)})"
        )
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        base = _closest_spec(props.name) or RTX5060TI
        backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        gpus.append(replace(base, name=props.name, memory_bytes=int(props.total_memory),
                            backend=backend))
    peer = len(gpus) > 1 and all(
        torch.cuda.can_device_access_peer(a, b)
        for a in range(len(gpus)) for b in range(len(gpus)) if a != b)
    link = LinkSpec("peer access" if peer else "no peer access", peer,
                    100.0 if peer else 0.0, 12.0, 6.0)
    if measure_link:
        link = _measure_link(torch, link, len(gpus))
    host_ram = _host_ram_bytes()
    return HardwareProfile("auto", f"this machine: {len(gpus)} GPU(s)", tuple(gpus), link,
                           host_ram, measured=measure_link, rocm_version=_version(
                               getattr(torch.version, "hip", None)),
                           torch_version=_version(torch.__version__))


def _version(text: str | None) -> tuple[int, int] | None:
    """'7.2.53211' -> (7, 2); '2.11.0+cu130' -> (2, 11); None when absent or unreadable."""
    if not text:
        return None
    try:
        major, minor = str(text).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _host_ram_bytes() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        return 32 * GiB


def _measure_link(torch, link: LinkSpec, gpu_count: int) -> LinkSpec:
    size = 256 * 1024 * 1024

    def timed(copy) -> float:
        copy()  # warm-up: first touch of pinned pages and peer mappings
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            copy()
        end.record()
        # the events are only readable once the copies finished
        end.synchronize()
        return 3 * size / (start.elapsed_time(end) / 1000.0) / GB

    dev0 = torch.device("cuda", 0)
    dst = torch.empty(size, dtype=torch.uint8, device=dev0)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    pinned_gbs = timed(lambda: dst.copy_(pinned, non_blocking=True))
    pageable_gbs = timed(lambda: dst.copy_(pageable))
    peer_gbs = link.peer_gbs
    if gpu_count > 1 and link.peer_access:
        src = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", 1))
        peer_gbs = timed(lambda: dst.copy_(src, non_blocking=True))
    return replace(link, peer_gbs=peer_gbs, host_pinned_gbs=pinned_gbs,
                   host_pageable_gbs=pageable_gbs)
