"""Starts `tests/dynamic_vram_cases.py` in a process of its own (DynamicVRAM has to be switched
on before ComfyUI is imported, and the other GPU tests run ComfyUI's legacy loader).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -m "comfyui and gpu" \
        -o addopts="--strict-markers" tests/test_dynamic_vram_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.gpu]

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).resolve().parent / "dynamic_vram_cases.py"


def test_dynamic_vram_cases_in_a_process_of_their_own():
    markers = "comfyui and gpu" + ("" if _gpus() >= 2 else " and not multi_gpu")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
         "-o", "addopts=--strict-markers", "-m", markers, str(CASES)],
        env={**os.environ, "H3_DYNAMIC_VRAM": "1"}, cwd=ROOT, capture_output=True, text=True,
        timeout=1800)
    out = run.stdout[-8000:] + run.stderr[-2000:]
    print(out)
    assert run.returncode == 0, out
    summary = run.stdout.strip().splitlines()[-1]
    if " passed" not in summary:
        pytest.skip(f"DynamicVRAM cases did not run: {summary}")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
