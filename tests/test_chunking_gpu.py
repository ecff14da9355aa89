"""Chunking on a GPU with full-size twin blocks: bit-identical, and memory as sizing predicts."""

from __future__ import annotations

import pytest
import torch
from block_workload import (
    attention_output_needs_copy,
    chunked_forwards,
    make_block_model,
    pass_workload,
    release_cached,
    rms_norm_temporary_bytes,
    run_blocks,
)
from twin import TwinConfig, TwinPatcher

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, sizing
from h3_multigpu.common import exact_rows

pytestmark = pytest.mark.gpu
RANK = 128


@pytest.fixture(scope="module")
def full_block():
    model, hooks = make_block_model(TwinConfig.full(blocks=1, refiner_blocks=0),
                                    device="cuda", lora_rank=RANK, seed=1)
    yield model, hooks
    del model, hooks
    release_cached(torch.device("cuda"))


def _forwards(model, config: ChunkingConfig | None):
    if config is None:
        return [block.forward for block in model.blocks]
    return chunked_forwards(apply_activation_chunking(TwinPatcher(model), config))


def _predicted(workload, config: ChunkingConfig | None) -> sizing.BlockPeak:
    chunks = (0, 0, 0) if config is None else (config.ffn_chunk, config.qkv_chunk,
                                                config.head_group)
    kernels = sizing.Kernels(mlp="twin", attention_output_copy=attention_output_needs_copy("cuda"),
                             norm_temp_bytes=rms_norm_temporary_bytes("cuda"))
    return sizing.block_peak_bytes(
        workload.tokens, sizing.BlockDims(), ffn_chunk=chunks[0], qkv_chunk=chunks[1],
        head_group=chunks[2], adapters=sizing.Adapters(rank=RANK, qkv=1, fc1=1),
        kernels=kernels)


# Chunks of at least floors.EXACT_MIN_ROWS (what the planner and "auto" choose, and what a request
# of that size is never realised below) keep cuBLAS on the unchunked call's GEMM kernels, and head
# groups of >= 4 heads with enough query tiles keep flash attention free of split-KV: the result is
# bit-identical. Smaller explicit chunks can change kernels (seen on an H200: 777/1000-row chunks
# gave max |diff| 0.03 in bf16): those are checked against the bf16 rounding bound (test below).
@pytest.mark.parametrize("config", [
    ChunkingConfig(ffn_chunk=5000, qkv_chunk=4500, head_group=12),  # nothing divides S or 56
    ChunkingConfig(ffn_chunk=4096, qkv_chunk=4096),
    ChunkingConfig(head_group=5),
    ChunkingConfig(ffn_chunk=16384, qkv_chunk=8192, head_group=14),
], ids=lambda c: f"{c.ffn_chunk}-{c.qkv_chunk}-{c.head_group}")
def test_full_block_chunked_is_bit_identical(full_block, config):
    model, hooks = full_block
    # 1312x736 at 39 frames (on H3's 17k+5 grid): 256 text + ~11.4k audio/video rows, so two
    # chunks of >= 4096 rows (the rank-128 LoRA on qkv/fc1 needs 2,300: the generic floor rules)
    workload = pass_workload(model, hooks, width=1312, height=736, frames=39)
    reference = run_blocks(workload, _forwards(model, None), repeats=1, warmup=0).output
    forwards = _forwards(model, config)
    chunked = run_blocks(workload, forwards, repeats=1, warmup=0).output
    plan = forwards[0].last_plan
    assert plan.inexact == (), plan  # the defaults' floors say exact here
    calls = (len(sizing.row_chunks(workload.tokens, plan.ffn_chunk, plan.ffn_floor)),
             len(sizing.row_chunks(workload.tokens, plan.qkv_chunk, plan.qkv_floor)),
             len(sizing.head_groups(56, plan.head_group, workload.tokens)))
    diff = (chunked.float() - reference.float()).abs().max().item()
    assert torch.equal(chunked, reference), f"max abs diff {diff}"
    if max(calls) == 1:
        # A GPU model that common/exact_rows.json does not list has no known row floor for the
        # LoRA-adapted linears, so explicit row chunks stay whole where the block fits unchunked
        # (chunking/wrappers.py): that is the feature here, and nothing was split to prove more.
        name = torch.cuda.get_device_name()
        assert exact_rows.table_for(name, "bfloat16") is None, (name, plan)
        assert plan.kept and all("left whole" in why for why in plan.kept), plan
        pytest.skip(f"{name} has no measured row floors: row chunks kept whole ({plan.kept[0]})")
    assert max(calls) > 1, calls  # engaged


@pytest.mark.multi_gpu
def test_on_activation_lora_attached_on_the_host_runs_on_cuda1():
    """The twin's adapters are made where the model is built and follow it to cuda:1 (this
    crashed with `mat2 is on cpu ... cuda:1`), chunked and with cuda:0 current."""
    model, hooks = make_block_model(TwinConfig.tiny(blocks=1, refiner_blocks=0), device="cpu",
                                    lora_rank=4, seed=1)
    model.to("cuda:1")
    torch.cuda.set_device(0)
    with torch.cuda.device(1):  # the twin's kitchen rope needs its device current
        workload = pass_workload(model, hooks, width=256, height=256, frames=5, text_tokens=16)
        reference = run_blocks(workload, _forwards(model, None), repeats=1, warmup=0).output
        chunked = run_blocks(workload, _forwards(model, ChunkingConfig(ffn_chunk=7, qkv_chunk=5)),
                             repeats=1, warmup=0).output
    assert hooks and hooks[0].adapter.weights[0].device.type == "cpu"
    # 5- and 7-row chunks may pick other GEMM kernels: bf16 rounding bound (k = 4)
    rel = ((chunked.float() - reference.float()).norm() / reference.float().norm()).item()
    assert rel <= 4 * 2.0**-8, f"relative L2 {rel:.2e}"


@pytest.mark.xfail(strict=True, reason=(
    "measures the twin's block, which frees h before attention; the sizing now models upstream's "
    "block, which holds h through attention (+S x hidden bf16: bench_chunk_block.py measured "
    "+0.5-0.6 GiB at 68,706 rows on upstream's block). On an H200: predicted 3.26 GB, measured "
    "2.91 GB (2026-12-02). To move onto upstream's block (tests/h3_checkpoints.py)"))
def test_predicted_peaks_match_measured_and_chunking_lowers_them(full_block):
    model, hooks = full_block
    # 1312x736 at 124 frames: S = 35,305 + 256 text
    workload = pass_workload(model, hooks, width=1312, height=736, frames=124)
    peaks = {}
    for name, config in (("plain", None),
                         ("chunked", ChunkingConfig(ffn_chunk=8192, qkv_chunk=8192,
                                                    head_group=8))):
        run = run_blocks(workload, _forwards(model, config), repeats=1, warmup=1)
        predicted = _predicted(workload, config).peak_bytes
        measured = run.activation_peak_bytes
        assert measured is not None
        assert abs(predicted - measured) <= 0.10 * measured, (name, predicted, measured)
        peaks[name] = measured
    assert peaks["chunked"] < 0.7 * peaks["plain"]  # MLP 136 kB/token -> ~82 kB


def test_auto_fits_a_tight_cap_and_stays_exact(full_block):
    model, hooks = full_block
    workload = pass_workload(model, hooks, width=1312, height=736, frames=124)
    reference = run_blocks(workload, _forwards(model, None), repeats=1, warmup=0)
    device = torch.device("cuda", torch.cuda.current_device())
    assert reference.activation_peak_bytes is not None
    # leave the block 70% of what it needed unchunked (x included): "auto" must chunk to fit
    allowed = (torch.cuda.memory_allocated(device) + workload.x_bytes
               + int(0.70 * reference.activation_peak_bytes))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(allowed / total, device)
    try:
        forwards = _forwards(model, ChunkingConfig("auto", "auto", "auto",
                                                   headroom_bytes=256 << 20))
        run = run_blocks(workload, forwards, repeats=1, warmup=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert forwards[0].last_chunks != (0, 0, 0)
    assert torch.equal(run.output, reference.output)


@pytest.mark.parametrize("config", [
    ChunkingConfig(ffn_chunk=1000, qkv_chunk=777, head_group=12),
    ChunkingConfig(ffn_chunk=2500, qkv_chunk=1024, head_group=28),
], ids=lambda c: f"{c.ffn_chunk}-{c.qkv_chunk}-{c.head_group}")
def test_small_chunks_stay_within_bf16_rounding(full_block, config):
    """Small chunks may change GEMM kernels: the difference must stay at bf16 rounding level
    (k = 4 units of bf16's 2^-8 relative rounding, in relative L2 over the block output)."""
    model, hooks = full_block
    workload = pass_workload(model, hooks, width=1312, height=736, frames=22)
    reference = run_blocks(workload, _forwards(model, None), repeats=1, warmup=0).output
    chunked = run_blocks(workload, _forwards(model, config), repeats=1, warmup=0).output
    rel = ((chunked.float() - reference.float()).norm() / reference.float().norm()).item()
    assert rel <= 4 * 2.0**-8, f"relative L2 {rel:.2e}"
