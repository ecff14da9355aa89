"""When a head subset of an attention call gives the same bits as the whole call, on a GPU.

A split call runs ComfyUI's attention function once per head subset (the root's heads, each
helper chunk). The result equals the unsplit call bit for bit when the function treats heads
independently AND picks the same kernel configuration for the subset as for the whole call.
PyTorch SDPA's kernels choose by shape: FlashAttention-2 splits the key range (another
summation order) when heads x row blocks are too few to fill the GPU, so a subset of few heads
at a short length comes out different in the last bits. `exact_range.json` holds, per SDPA
backend, the fewest heads x rows per SM at which a subset call is still exact (measured with
`dev/bench/bench_split_exactness.py`; the lead regenerates it from the sweep's JSON). Dual-Sage
sizes helper chunks to stay at or above it and keeps a call whole on the root otherwise.

On the CPU (`dev/bench/bench_split_exactness_cpu.py`, the file's "cpu" entry): ComfyUI's
sub-quadratic (its CPU default), SDPA and basic attention give a subset of 2 or more heads the
whole call's bits, fp32 and bf16, with 1, 2 or 4 threads; a 1-head call differs once torch runs
more than one thread (fp32 with all three, bf16 with SDPA; one matrix is then split over the
threads: up to 1.4e-6 seen), so with more than one thread a CPU subset needs 2 heads
(`docs/results/split_exactness_cpu.json`: 255 of 3,798 cases, every one a 1-head subset).
Other devices (MPS, XPU, ...) are not measured: their calls stay whole.

Exact is claimed only for the functions measured (`MEASURED_FUNCTIONS`); the status line says
"exact: yes (...)" there and "exact: no, <why>" elsewhere (`claim`).
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
# attention functions whose head subsets were measured against the whole call, per device type:
# ComfyUI's (their names in comfy.ldm.modules.attention) and this pack's SDPA backend
MEASURED_FUNCTIONS = {
    "cuda": frozenset({"attention_pytorch", "sdpa"}),
    "cpu": frozenset({"attention_sub_quad", "attention_pytorch", "attention_basic", "sdpa"}),
}


@dataclass(frozen=True)
class ExactRange:
    """Per SDPA backend: fewest heads x rows per SM of an exact subset call (None: never); on
    the CPU the fewest heads of an exact subset, with one torch thread and with more."""

    per_sm: dict[str, float | None]
    source: str = ""
    cpu_min_heads: int = 2
    cpu_min_heads_one_thread: int = 1
    cpu_source: str = ""

    @classmethod
    def load(cls, path: Path | str = RANGE_FILE) -> ExactRange:
        data = json.loads(Path(path).read_text())
        per_sm = {name: entry.get("min_heads_x_rows_per_sm")
                  for name, entry in data["backends"].items()}
        cpu = data.get("cpu", {})
        return cls(per_sm=per_sm, source=data.get("source", ""),
                   cpu_min_heads=int(cpu.get("min_heads", 2)),
                   cpu_min_heads_one_thread=int(cpu.get("min_heads_one_thread", 1)),
                   cpu_source=cpu.get("source", ""))

    def cpu_heads(self) -> int:
        """Fewest heads of an exact CPU subset with the threads torch uses now."""
        if torch.get_num_threads() == 1:
            return self.cpu_min_heads_one_thread
        return self.cpu_min_heads

    def min_heads(self, device: torch.device, seq_len: int, dtype: torch.dtype,
                  head_dim: int) -> int | None:
        """Fewest heads a call of `seq_len` rows on `device` may carry and stay exact."""
        if device.type == "cpu":
            return self.cpu_heads()
        if device.type != "cuda":
            return None  # not measured: calls stay whole
        value = self.per_sm.get(sdpa_backend(device, dtype, head_dim))
        if value is None:
            return None
        return max(1, math.ceil(value * sm_count(device) / max(seq_len, 1)))

    def describe(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        if device.type == "cpu":
            threads = torch.get_num_threads()
            return (f"subsets of >= {self.cpu_heads()} heads on the CPU with {threads} "
                    f"thread{'s' if threads != 1 else ''}, dev/bench/bench_split_exactness_cpu.py")
        if device.type != "cuda":
            return f"no exact range measured on {device.type}: calls stay whole"
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


@cache
def default_range() -> ExactRange:
    """The shipped `exact_range.json` (read once)."""
    return ExactRange.load()


def function_name(function) -> str:
    """An attention function's name as `MEASURED_FUNCTIONS` lists it: ComfyUI's wrapped
    kernels by their own name (`wrap_attn` keeps it), a `kernels` backend by its registry name."""
    backend = getattr(function, "backend", None)
    name = getattr(backend, "name", backend)
    if isinstance(name, str):
        return name
    inner = getattr(function, "__wrapped__", function)
    return getattr(inner, "__name__", type(inner).__name__)


def claim(device: torch.device, function: str | None, exact_range: ExactRange | None, *,
          dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str:
    """The status line's exactness claim for head subsets of `function` split from `device`:
    "exact: yes (...)" only where measured, else "exact: no, <why>"."""
    if exact_range is None:
        return ("exact: no, exact_only is off: calls are split outside the measured exact "
                "range too (may differ from one GPU in the last bits)")
    if function is None:
        return ("exact: no, the attention function is chosen per call (an override installed "
                "before decides), and only measured functions are known exact per head subset")
    measured = MEASURED_FUNCTIONS.get(device.type, frozenset())
    if function not in measured:
        return (f"exact: no, {function}'s head subsets are not measured against its whole call "
                f"on {device.type} (measured: {', '.join(sorted(measured)) or 'none'})")
    return (f"exact: yes (same bits as one GPU: splits only where measured exact, "
            f"{exact_range.describe(device, dtype, head_dim)})")
