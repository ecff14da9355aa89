"""On a GPU the hardware data lists, the rates the time model uses are what the card measures
(within 10%): bf16 and INT8 ConvRot GEMMs at H3's block shapes, SDPA under ComfyUI's priority,
a pinned host copy. Runs `dev/bench/bench_time_model.py`'s measurements (about a minute).

    python -m pytest -q -o addopts="" -m gpu tests/test_planner_time_gpu.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from h3_multigpu.planner.hardware import spec_for_name

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[1] / "dev" / "bench" / "bench_time_model.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_time_model", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured():
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    if spec_for_name(name) is None:
        pytest.skip(f"{name} is not in planner/profiles.json: nothing to compare with")
    bench = _bench()
    rows = [bench.bench_bf16_gemm(device, bench.GEMM_ROWS, 5, bench.LINEARS),
            bench.bench_int8_gemm(device, bench.GEMM_ROWS, 5, bench.LINEARS),
            *bench.bench_attention(device, (35_305,), 5),
            *bench.bench_copies(device, 385_000_000, 5)]
    return name, bench, {r["row"]: r for r in rows if "measured" in r}


# "attention_cudnn" is a lab-only rate tied to the lab's torch build (PyTorch's default
# priority picks other kernels in other releases): not a rate the planner gives a user
@pytest.mark.parametrize("row", ["bf16_gemm", "int8_gemm", "attention_sdpa"])
def test_measured_rates_match_the_hardware_data(measured, row):
    name, bench, rows = measured
    want = bench.predicted(rows[row], name)
    if want is None:
        pytest.skip(f"the data has no {row} rate for {name}")
    assert rows[row]["measured"] == pytest.approx(want, rel=0.10), rows[row]


def test_the_pinned_copy_rate_where_the_data_measured_it(measured):
    name, bench, rows = measured
    if spec_for_name(name).name != "NVIDIA H200":
        pytest.skip("only the lab's H200 link is measured in the data")
    assert rows["h2d_pinned"]["measured"] == pytest.approx(
        bench.predicted(rows["h2d_pinned"], name), rel=0.10)
