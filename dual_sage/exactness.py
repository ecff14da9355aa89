"""When a head subset of an attention call gives the same bits as the whole call, on a GPU.

A split call runs ComfyUI's attention function once per head subset (the root's heads, each
helper chunk). The result equals the unsplit call bit for bit when the function treats heads
independently AND picks the same kernel configuration for the subset as for the whole call.
PyTorch SDPA's kernels choose by shape: FlashAttention-2 splits the key range (another
summation order) when heads x row blocks are too few to fill the GPU, so a subset of few heads
at a short length comes out different in the last bits. `exact_range.json` holds, per SDPA
backend, the fewest heads x rows per SM at which a subset call is still exact (measured with
`bench/bench_split_exactness.py`; the lead regenerates it from the sweep's JSON). Dual-Sage
sizes helper chunks to stay at or above it and keeps a call whole on the root otherwise.

On the CPU every backend ComfyUI uses (sub-quadratic, SDPA) attends each head on its own:
every subset is exact (the CPU tests check it with 1 and 2 threads).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

RANGE_FILE = Path(__file__).with_name("exact_range.json")
SDPA_PRIORITY = ("flash", "cudnn", "efficient", "math")  # ComfyUI's order (comfy.ops)


@dataclass(frozen=True)
class ExactRange:
    """Per SDPA backend: fewest heads x rows per SM of an exact subset call (None: never)."""

    per_sm: dict[str, float | None]
    source: str = ""

    @classmethod
    def load(cls, path: Path | str = RANGE_FILE) -> ExactRange:
        data = json.loads(Path(path).read_text())
        per_sm = {name: entry.get("min_heads_x_rows_per_sm")
                  for name, entry in data["backends"].items()}
        return cls(per_sm=per_sm, source=data.get("source", ""))

    def min_heads(self, device: torch.device, seq_len: int, dtype: torch.dtype,
                  head_dim: int) -> int | None:
        """Fewest heads a call of `seq_len` rows on `device` may carry and stay exact."""
        if device.type != "cuda":
            return 1
        value = self.per_sm.get(sdpa_backend(device, dtype, head_dim))
        if value is None:
            return None
        return max(1, math.ceil(value * sm_count(device) / max(seq_len, 1)))

    def describe(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        if device.type != "cuda":
            return "every head subset (CPU)"
        backend = sdpa_backend(device, dtype, head_dim)
        value = self.per_sm.get(backend)
        if value is None:
            return f"never for SDPA {backend} (not known exact: calls stay whole)"
        return (f"SDPA {backend}: >= {value * sm_count(device):,.0f} heads x rows per call "
                f"({sm_count(device)} SMs)")


@cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sdpa_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The SDPA backend ComfyUI's priority (flash > cudnn > efficient > math) runs for a
    dense, unmasked `[1, H, S, head_dim]` call of `dtype` on `device`."""
    half = dtype in (torch.float16, torch.bfloat16)
    if torch.version.hip is not None:  # other kernels under the same names: measure them apart
        return "rocm_" + ("flash" if half and head_dim <= 256 else "math")
    major, _ = torch.cuda.get_device_capability(device)
    cuda = torch.backends.cuda
    if half and major >= 8 and head_dim % 8 == 0 and head_dim <= 256 and cuda.flash_sdp_enabled():
        return "flash"
    if half and major >= 8 and head_dim <= 128 and cuda.cudnn_sdp_enabled():
        return "cudnn"
    if cuda.mem_efficient_sdp_enabled():
        return "efficient"
    return "math"


def derive_per_sm(cases: list[dict]) -> float | None:
    """The threshold `exact_range.json` stores, from sweep cases {heads, seq_len, sms, exact}.

    Every case at or above it was exact: the smallest exact value above the largest inexact
    one; None when no exact case lies above every inexact one.
    """
    values = [(c["heads"] * c["seq_len"] / c["sms"], bool(c["exact"])) for c in cases]
    worst = max((v for v, exact in values if not exact), default=None)
    above = [v for v, exact in values if exact and (worst is None or v > worst)]
    if not above:
        return None
    return round(min(above), 1)
