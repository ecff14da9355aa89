"""The split video decode on real GPUs (streams, peer copies, device-side writes).

The stand-in VAE (tests/decode_standin.py) in bf16 on cuda:0 with every other GPU as a helper
must give its own one-GPU decode bit for bit, with the output on the host (ComfyUI's default)
and on a GPU (ComfyUI's --gpu-only), and when a helper fails mid-way. The real upstream VAE on
two GPUs is in test_decode_comfyui.py (multi_gpu + comfyui) and dev/bench/bench_decode.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from decode_standin import StandInVideoVAE

from h3_multigpu.decode import WindowLayout, assign_windows
from h3_multigpu.decode.executor import SplitDecode
from h3_multigpu.decode.shares import DeviceShare

pytestmark = pytest.mark.multi_gpu


def _setup(t: int, output_device: str = "cpu"):
    root = torch.device("cuda", 0)
    with torch.cuda.device(root):
        model = StandInVideoVAE(width=64, tile=8, tile_batch=3, dtype=torch.bfloat16).to(root)
        z = torch.randn(1, 24, t, 12, 40, generator=torch.Generator().manual_seed(t)).to(
            root, torch.bfloat16)
        with torch.no_grad():
            expected = model.decode_temporal(z.clone()).cpu()
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    _, windows = WindowLayout().windows(t)
    ranges = assign_windows(windows, [1.0] * len(devices))
    shares = [DeviceShare(d, r, model if d == root else None) for d, r in zip(devices, ranges,
                                                                              strict=True)]
    out = torch.full(model.decode_output_shape(z.shape), float("nan"), device=output_device)
    return model, z, expected, shares, out


@pytest.mark.parametrize("t", [17, 37, 72])
def test_split_on_gpus_is_bit_identical_with_a_host_output(t):
    model, z, expected, shares, out = _setup(t)
    with torch.cuda.device(0), torch.no_grad():
        report = SplitDecode(model, WindowLayout(), shares, output=out).run(z)
    assert torch.equal(out, expected)
    assert report.handovers == len([s for s in shares if s.count]) - 1
    assert "cuda:1" in report.copy_seconds and report.same_tile_batches
    assert len({c for c in model.calls}) == len([s for s in shares if s.count])


def test_split_on_gpus_writes_a_gpu_output_exactly():
    model, z, expected, shares, out = _setup(37, output_device="cuda:0")
    with torch.cuda.device(0), torch.no_grad():
        SplitDecode(model, WindowLayout(), shares, output=out).run(z)
    assert torch.equal(out.cpu(), expected)


def test_failing_gpu_helper_falls_back_to_the_root(caplog):
    model, z, expected, shares, out = _setup(37)
    model.fail_copies_after = 1
    with caplog.at_level(logging.WARNING, logger="h3_multigpu"), torch.cuda.device(0), \
            torch.no_grad():
        report = SplitDecode(model, WindowLayout(), shares, output=out).run(z)
    assert torch.equal(out, expected)
    assert "cuda:1" in report.failed
    assert sum("failed" in r.getMessage() for r in caplog.records) == len(shares) - 1
