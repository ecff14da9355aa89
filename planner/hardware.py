"""Device inventory: the hardware data file (`profiles.json`) and the real machine.

A profile is data: per GPU its memory and the rates the time model needs (bf16 and INT8 GEMMs at
H3's block shapes, each attention kernel, memory bandwidth), and the link between the GPUs. Each
number in `profiles.json` says where it comes from (measured here, a datasheet, a published run,
or derived from those); `GPUSpec.sources` carries those words into the plan.

A GPU of the real machine is matched to the data by its exact model name (or an alias listed in
the data): "NVIDIA GeForce RTX 3060 Ti" is not an RTX 3060 and not a 5060 Ti. A card the data
does not list gets stand-in rates, marked `known=False`, and the plan says so.

No torch import at module level: `detect_hardware()` imports it lazily so the planner runs on a
machine with no GPU and no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 1024**3
GB = 1000**3
DATA_FILE = Path(__file__).with_name("profiles.json")
ATTENTION_KERNELS = ("sdpa", "flash", "sage", "ck")  # what a user can run; "cudnn": lab only
QUANTIZED_ATTENTION = ("sage", "ck")  # INT8 QK: approximate, not the bits of SDPA


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    name: str
    memory_bytes: int
    matmul_tflops: float  # effective dense GEMM rate in the compute dtype (bf16, fp16 on Volta)
    memory_bandwidth_gbs: float
    # effective rate of each attention kernel this card runs (TFLOPS of 4 S^2 d H per call)
    attention_rates: dict[str, float] = field(default_factory=dict)
    int8_matmul_tops: float | None = None  # comfy-kitchen int8_linear; None: no INT8 GEMM
    compute_dtype: str = "bf16"
    backend: str = "cuda"  # "cuda" or "rocm"
    known: bool = True  # False: not in profiles.json, the rates stand in for an unknown card
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        return f"{self.name} {self.memory_bytes / GiB:.0f} GiB"

    @property
    def attention_tflops(self) -> float:
        """ComfyUI's default attention (PyTorch SDPA under ComfyUI's backend priority)."""
        return self.attention_rates["sdpa"]

    @property
    def int8_attention_tflops(self) -> float:
        """The fastest INT8-QK kernel this card has (0 when none)."""
        return max((self.attention_rates.get(k, 0.0) for k in QUANTIZED_ATTENTION), default=0.0)

    def attention_rate(self, kernel: str) -> tuple[float, str]:
        """(rate, the kernel it is the rate of): `kernel`'s, or SDPA's when this card has no
        rate for it (the caller says so in the plan)."""
        if kernel in self.attention_rates:
            return self.attention_rates[kernel], kernel
        return self.attention_rates["sdpa"], "sdpa"

    def gemm_rate(self, dit_dtype: str) -> tuple[float, str]:
        """(rate, what runs) of the DiT's linears: INT8 GEMMs for the INT8 checkpoint where the
        card has them, else the compute dtype (ComfyUI dequantizes the weight per GEMM)."""
        if dit_dtype == "int8" and self.int8_matmul_tops:
            return self.int8_matmul_tops, "int8"
        return self.matmul_tflops, self.compute_dtype


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    kind: str  # "nvlink", "pcie4 x8", ...
    peer_access: bool
    peer_gbs: float  # GPU<->GPU with peer access (0 without)
    host_pinned_gbs: float  # pinned host -> GPU
    host_pageable_gbs: float  # pageable host -> GPU (through a driver bounce buffer)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

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
    measured: bool = False  # True when the link was measured on the real machine
    notes: tuple[str, ...] = field(default=())
    rocm_version: tuple[int, int] | None = None  # (major, minor) of a ROCm build of torch
    torch_version: tuple[int, int] | None = None  # None: assumed new enough (>= 2.8)
    host_ram_source: str = "the profile's RAM"  # where host_ram_bytes comes from, in words

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


# ------------------------------------------------------------------ the data file
def _number(entry: dict, key: str, sources: dict[str, str]) -> float | None:
    item = entry[key]
    sources[key] = f"{item['kind']}: {item['source']}"
    return item["value"]


def _gpu_from_data(entry: dict) -> GPUSpec:
    sources: dict[str, str] = {}
    rates = {}
    for kernel, item in entry["attention_tflops"].items():
        rates[kernel] = float(item["value"])
        sources[f"attention.{kernel}"] = f"{item['kind']}: {item['source']}"
    int8 = _number(entry, "int8_gemm_tops", sources)
    return GPUSpec(name=entry["name"],
                   memory_bytes=int(_number(entry, "memory_gib", sources) * GiB),
                   matmul_tflops=float(_number(entry, "bf16_gemm_tflops", sources)),
                   memory_bandwidth_gbs=float(_number(entry, "memory_bandwidth_gbs", sources)),
                   attention_rates=rates, int8_matmul_tops=None if int8 is None else float(int8),
                   compute_dtype=entry["compute_dtype"], backend=entry["backend"],
                   sources=sources)


def _link_from_data(entry: dict) -> LinkSpec:
    sources: dict[str, str] = {}
    return LinkSpec(kind=entry["kind"], peer_access=bool(entry["peer_access"]),
                    peer_gbs=float(_number(entry, "peer_gbs", sources)),
                    host_pinned_gbs=float(_number(entry, "host_pinned_gbs", sources)),
                    host_pageable_gbs=float(_number(entry, "host_pageable_gbs", sources)),
                    sources=sources)


def _load(path: Path = DATA_FILE) -> tuple[dict[str, GPUSpec], dict[str, str],
                                          dict[str, HardwareProfile]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    specs, names = {}, {}
    for entry in data["gpus"]:
        spec = _gpu_from_data(entry)
        specs[spec.name] = spec
        for name in (spec.name, *entry.get("aliases", ())):
            names[_normal(name)] = spec.name
    profiles = {}
    for entry in data["profiles"]:
        gpu = specs[entry["gpu"]]
        rocm = entry.get("rocm_version")
        profiles[entry["name"]] = HardwareProfile(
            entry["name"], entry["description"], (gpu,) * entry["count"],
            _link_from_data(entry["link"]), int(entry["host_ram_gib"] * GiB),
            notes=tuple(entry.get("notes", ())), rocm_version=tuple(rocm) if rocm else None)
    return specs, names, profiles


def _normal(name: str) -> str:
    return " ".join(name.split()).casefold()


SPECS, _NAMES, PROFILES = _load()
H200 = SPECS["NVIDIA H200"]
RTX5090 = SPECS["NVIDIA GeForce RTX 5090"]
RTX5060TI = SPECS["NVIDIA GeForce RTX 5060 Ti"]
RTX3060 = SPECS["NVIDIA GeForce RTX 3060"]
V100 = SPECS["Tesla V100-SXM2-32GB"]
R9700 = SPECS["AMD Radeon AI PRO R9700"]
STAND_IN = RTX5060TI  # rates for a card the data does not list (a mid-range card), flagged


def spec_for_name(name: str) -> GPUSpec | None:
    """The data's GPU of exactly this model name (case and spacing aside), or None."""
    key = _NAMES.get(_normal(name))
    return SPECS[key] if key is not None else None


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


def gpu_from_device(name: str, memory_bytes: int, backend: str) -> GPUSpec:
    """A real GPU: the data's rates for its exact model name, or the stand-in's, flagged."""
    spec = spec_for_name(name)
    if spec is None:
        return replace(STAND_IN, name=name, memory_bytes=memory_bytes, backend=backend,
                       known=False)
    return replace(spec, name=name, memory_bytes=memory_bytes, backend=backend)


def detect_hardware(measure_link: bool = False) -> HardwareProfile:
    """The real machine's GPUs (torch.cuda, CUDA or ROCm) as a profile.

    Memory and names are read; rates come from the data for the exact model name (or stand in,
    flagged). With `measure_link`, host->GPU and GPU->GPU bandwidths are measured with 256 MiB
    copies (a second or two); otherwise they are estimates.
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise ValueError("--gpus auto needs PyTorch; use --profile NAME instead") from exc
    from ..comfy_seam.devices import gpu_count

    count = gpu_count()  # inside ComfyUI: the GPUs it uses (--cuda-device), not all torch sees
    if count == 0:
        raise ValueError(
            "no CUDA/ROCm GPU is visible (to PyTorch, or to ComfyUI where it runs); use a "
            "built-in profile instead "
            f"(--profile {' | '.join(PROFILES)})"
        )
    backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    gpus = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        gpus.append(gpu_from_device(props.name, int(props.total_memory), backend))
    peer = len(gpus) > 1 and all(
        torch.cuda.can_device_access_peer(a, b)
        for a in range(len(gpus)) for b in range(len(gpus)) if a != b)
    estimate = "estimate: not measured (--measure-link measures it)"
    link = LinkSpec(kind="peer access" if peer else "no peer access", peer_access=peer,
                    peer_gbs=100.0 if peer else 0.0, host_pinned_gbs=12.0,
                    host_pageable_gbs=6.0, sources={k: estimate for k in (
                        "peer_gbs", "host_pinned_gbs", "host_pageable_gbs")})
    if measure_link:
        link = _measure_link(torch, link, len(gpus))
    host_ram, ram_source = _host_ram()
    return HardwareProfile("auto", f"this machine: {len(gpus)} GPU(s)", tuple(gpus), link,
                           host_ram, measured=measure_link, rocm_version=_version(
                               getattr(torch.version, "hip", None)),
                           torch_version=_version(torch.__version__),
                           host_ram_source=ram_source)


def _version(text: str | None) -> tuple[int, int] | None:
    """'7.2.53211' -> (7, 2); '2.11.0+cu130' -> (2, 11); None when absent or unreadable."""
    if not text:
        return None
    try:
        major, minor = str(text).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _host_ram() -> tuple[int, str]:
    """This host's memory, capped by its cgroup limit (planner.host), and where it comes from."""
    from .host import host_memory_limit

    limit, source = host_memory_limit()
    if limit is None:
        return 32 * GiB, "unknown: 32 GiB assumed"
    return limit, source


def _host_ram_bytes() -> int:
    return _host_ram()[0]


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
    measured = "measured on this machine (256 MiB copies)"
    return replace(link, peer_gbs=peer_gbs, host_pinned_gbs=pinned_gbs,
                   host_pageable_gbs=pageable_gbs,
                   sources={k: measured for k in ("peer_gbs", "host_pinned_gbs",
                                                  "host_pageable_gbs")})
