"""Sequence parallel on CPU stand-ins: row shares under the adapters' row floors, and release.

Row shares are GEMM calls of their own: with on-activation adapters their floors
(`chunking/exact_rows.json`, installed here as a fake table for the CPU and the tiny twin's
shapes) decide whether a split step can be bit-identical; outside them the step falls back
the mode's usual way and the status line says why. `release()` must drop every tensor the
split steps made (the replica, link buffers, per-block buffers), without waiting for the
garbage collector. Single-threaded, like tests/test_sequence.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from twin import TwinPatcher, make_twin
from twin.adapters import attach_activation_lora

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common import exact_rows
from h3_multigpu.sequence import (
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence import runner as runner_module
from h3_multigpu.sequence import status as sequence_status
from h3_multigpu.sequence import threads as threads_module

RANK = 4
# the tiny twin (hidden 64, inner 128, ffn 96) with rank-4 adapters, fp32 on the CPU
FAKE = {"64->4": 12, "4->384": 8, "128->4": 12, "4->64": 8, "4->192": 8, "96->4": 12}


@pytest.fixture(autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as ComfyUI runs on a CPU; shares keep >= 16 rows (test_sequence)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_floors(monkeypatch):
    floors = dict(FAKE)
    table = exact_rows.GemmTable("cpu", "float32", floors, "fake (test)")
    monkeypatch.setattr(exact_rows, "table_for",
                        lambda device, dtype: table if (device, dtype) == ("cpu",
                                                                           "float32") else None)
    monkeypatch.setattr(sequence_status, "_warned", set())
    return floors


@pytest.fixture
def lora_twin(tiny_config, tiny_inputs):
    model = make_twin(tiny_config, seed=0)
    for i, block in enumerate(model.blocks):
        for j, linear in enumerate((block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1,
                                    block.mlp.fc2)):
            attach_activation_lora(linear, RANK, seed=10 * i + j)
    return model, TwinPatcher(model).apply_model(*tiny_inputs)  # S = 44: shares of 22 rows


def _split(model, parallel="sequence"):
    return apply_sequence_parallel(TwinPatcher(model), SequenceParallelConfig(
        helpers=("cpu",), parallel=parallel))


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_shares_above_the_adapters_floors_run_split(fake_floors, lora_twin, tiny_inputs):
    model, reference = lora_twin
    patched = _split(model)
    assert _same(patched.apply_model(*tiny_inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps["sequence"] == 1 and mode.blocks_run == 3
    assert mode.share_floor(torch.float32)[0] == 12  # 22-row shares: above it


@pytest.mark.parametrize("fc2_down,said", [
    (30, "row shares below 30 (the measured floor of the blocks' GEMMs with their "
         "on-activation adapters on cpu)"),
    (None, "on-activation LoRA on fc2, rank 4: no row share is known to be bit-identical"),
])
def test_shares_below_a_floor_fall_back_and_say_why(fake_floors, lora_twin, tiny_inputs, caplog,
                                                    fc2_down, said):
    fake_floors["96->4"] = fc2_down
    model, reference = lora_twin
    patched = _split(model)
    caplog.set_level(logging.WARNING, logger="h3_multigpu.sequence.status")
    for _ in range(2):
        assert _same(patched.apply_model(*tiny_inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps["sequence"] == 0 and mode.steps["off"] == 2 and mode.blocks_run == 0
    line = protocol.status_lines(patched)["sequence"]
    assert "sequence refused at 44 tokens: " in line and said in line, line
    assert said in mode.decisions[44].reason
    assert len([r for r in caplog.records if said in r.getMessage()]) == 1


def test_without_a_table_the_cpu_stand_in_keeps_its_rule(monkeypatch, lora_twin, tiny_inputs):
    monkeypatch.setattr(exact_rows, "table_for", lambda device, dtype: None)
    model, reference = lora_twin
    patched = _split(model)
    assert _same(patched.apply_model(*tiny_inputs), reference)
    assert get_sequence_parallel(patched).steps["sequence"] == 1


class _Allocations(TorchDispatchMode):
    """Weak references to every tensor any op returns while active."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[weakref.ref, str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), str(func), tuple(t.shape)))
        return out

    def alive(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(func, shape) for ref, func, shape in self.made if ref() is not None]


@pytest.mark.parametrize("case", ["two steps", "helper failure"])
def test_release_drops_every_tensor_the_split_steps_made(monkeypatch, tiny_twin, tiny_inputs,
                                                         case):
    if case == "helper failure":
        original, failed = runner_module.ShareAttention._attend, []

        def failing(self, func, q, k, v, g, kwargs):
            if not failed and self.k == 1:
                failed.append(1)
                raise torch.OutOfMemoryError("helper out of memory (simulated)")
            return original(self, func, q, k, v, g, kwargs)

        monkeypatch.setattr(runner_module.ShareAttention, "_attend", failing)
        monkeypatch.setattr(sequence_status, "_warned", set())  # other tests' warnings stay
    patched = _split(tiny_twin)
    mode = get_sequence_parallel(patched)
    gc.collect()
    gc.disable()  # what stays alive must be freed by release itself, not by a later collection
    try:
        tracked = _Allocations()
        entered = threads_module.TorchState.entered

        @contextlib.contextmanager
        def tracking(state, device):  # the mode is thread-local: each share's thread too
            with entered(state, device), tracked:
                yield

        monkeypatch.setattr(threads_module.TorchState, "entered", tracking)
        with tracked:
            for _ in range(2):
                out = patched.apply_model(*tiny_inputs)
        del out
        assert mode.steps["sequence"] >= 1 and tracked.made
        replica = [weakref.ref(t) for w in mode.helper_weights.values() for t in w.replica
                   if t is not None]
        assert replica or case == "helper failure"
        mode.release()
        assert tracked.alive() == [] and all(r() is None for r in replica)
    finally:
        gc.enable()
