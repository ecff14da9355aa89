"""Torch-free sizing and the residency policy agree with the runtime's layout and slots."""

import ast
import inspect

import pytest
import torch
from twin import TwinConfig, make_twin

from h3_multigpu.common.block_weights import BlockLayout, module_bytes
from h3_multigpu.offload import policy, sizing


def test_sizing_module_imports_no_torch():
    tree = ast.parse(inspect.getsource(sizing))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in imported


def test_block_flat_bytes_matches_runtime_layout_of_a_full_block():
    model = make_twin(TwinConfig.full(), dtype=torch.bfloat16, device="meta")
    block = model.blocks[0]
    tensors = list(block.parameters()) + list(block.buffers())
    predicted = sizing.block_flat_bytes(t.numel() * t.element_size() for t in tensors)
    assert predicted == BlockLayout.of(tensors).nbytes == module_bytes(block)
    # the four bf16 linears dominate: 771 MB of ~773 MB
    assert 770_703_360 <= predicted < 780_000_000


def test_alignment_rounds_up_each_tensor():
    assert sizing.aligned(1) == 256 and sizing.aligned(256) == 256 and sizing.aligned(257) == 512
    assert sizing.block_flat_bytes([4, 4, 300]) == 256 + 256 + 512


def test_slot_ring_and_vram_for_full_model():
    block = 770_703_360
    assert sizing.slot_count(2, 30) == 3 and sizing.slot_count(3, 2) == 2
    assert sizing.slot_count(2, 0) == 0
    assert sizing.slot_ring_bytes(block, 2, 30) == 3 * block
    resident_all = sizing.streamed_weight_vram_bytes(blocks=50, resident=50, block_bytes=block,
                                                     lookahead=2)
    streamed = sizing.streamed_weight_vram_bytes(blocks=50, resident=20, block_bytes=block,
                                                 lookahead=2)
    assert resident_all == 50 * block and streamed == 23 * block


def test_resident_blocks_for_budget_is_the_largest_count_that_fits():
    block = 100
    assert sizing.resident_blocks_for_budget(5000, blocks=50, block_bytes=block, lookahead=2) == 50
    got = sizing.resident_blocks_for_budget(2000, blocks=50, block_bytes=block, lookahead=2)
    assert got == 17  # 17 resident + 3 slots = 20 blocks
    assert sizing.streamed_weight_vram_bytes(blocks=50, resident=got, block_bytes=block,
                                             lookahead=2) <= 2000
    assert sizing.streamed_weight_vram_bytes(blocks=50, resident=got + 1, block_bytes=block,
                                             lookahead=2) > 2000
    assert sizing.resident_blocks_for_budget(250, blocks=50, block_bytes=block, lookahead=2) == 0


def test_pinned_arena_stops_at_budget_and_staging_ring_is_double_buffered():
    assert sizing.pinned_arena_bytes([10, 10, 10], None) == 30
    assert sizing.pinned_arena_bytes([10, 10, 10], 25) == 20
    assert sizing.staging_ring_bytes(10) == 20 and sizing.staging_ring_bytes(0) == 0


def test_copy_time_and_step_overhead_from_the_h200_anchors():
    copy_s = sizing.copy_seconds(770_703_360, 54.6)
    assert copy_s == pytest.approx(0.0141, rel=0.01)  # measured 14.2 ms
    # 16k tokens: linears 18.5 ms, attention ~11.6 ms -> ~30 ms per block: hidden
    assert sizing.step_overhead_seconds(blocks=50, streamed=30, block_compute_s=0.030,
                                        block_copy_s=copy_s) == 0.0
    # a copy longer than the compute it can hide behind shows on the step
    over = sizing.step_overhead_seconds(blocks=10, streamed=10, block_compute_s=0.010,
                                        block_copy_s=0.015, unhidden_copies=2)
    assert over == pytest.approx(10 * 0.005 + 2 * 0.015)
    with pytest.raises(ValueError, match="link_gb_per_s"):
        sizing.copy_seconds(1, 0)


def test_spread_policy_starts_at_zero_and_spaces_evenly():
    assert policy.spread_resident(50, 0) == ()
    assert policy.spread_resident(50, 50) == tuple(range(50))
    resident = policy.spread_resident(50, 20)
    assert resident[0] == 0 and len(set(resident)) == 20
    assert policy.longest_streamed_run(50, resident) == 2
    assert policy.longest_streamed_run(50, tuple(range(20))) == 30  # first-N: one long run
    assert policy.spread_resident(6, 2) == (0, 3)
    with pytest.raises(ValueError, match="resident_blocks=7"):
        policy.spread_resident(6, 7)


def test_streamed_order_puts_refiner_first_and_skips_resident():
    order = policy.streamed_order(6, (0, 3), refiner_blocks=2)
    assert order == ["token_refiner.blocks.0", "token_refiner.blocks.1",
                     "blocks.1", "blocks.2", "blocks.4", "blocks.5"]
    assert policy.streamed_order(6, (0, 3), 2, stream_refiner=False)[0] == "blocks.1"
