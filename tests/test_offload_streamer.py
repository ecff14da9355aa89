"""Slot bookkeeping, ordering of copies and compute, staging, quantized weights, refresh.

A recording engine stands in for CUDA streams: it performs copies synchronously (so outputs
stay checkable) and logs every record / copy / wait, and the tests check the ordering rules a
GPU needs: a slot is refilled only after the event recorded at the end of its block's compute,
compute waits on the copy that filled its slot, and nothing synchronises the host.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from comfy_kitchen.tensor.base import QuantizedTensor

from h3_multigpu.offload.streamer import BlockStreamer, Source
from h3_multigpu.offload.weights import module_bytes


class FakeEvent:
    def __init__(self, kind: str, serial: int):
        self.kind, self.serial = kind, serial

    def __repr__(self) -> str:
        return f"{self.kind}#{self.serial}"


class RecordingEngine:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self.serial = 0
        self.host_waits = 0
        self.syncs = 0

    def _event(self, kind: str) -> FakeEvent:
        self.serial += 1
        return FakeEvent(kind, self.serial)

    def record_compute(self) -> FakeEvent:
        event = self._event("released")
        self.log.append(("record", event))
        return event

    def copy(self, dst, src, after):
        dst.copy_(src)
        event = self._event("ready")
        self.log.append(("copy", dst.data_ptr(), tuple(after), event))
        return event

    def compute_wait(self, event) -> None:
        self.log.append(("wait", event))

    def host_wait(self, event) -> None:
        self.host_waits += 1

    def synchronize(self) -> None:
        self.syncs += 1


class Block(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.register_buffer("offset", torch.randn(width, generator=gen))

    def forward(self, x):
        return self.norm(x + self.lin(x)) + self.offset


def run(blocks, streamer, x, log=None):
    """The block loop; with `log`, begin/end of each streamed block join the engine's log."""
    for i, block in enumerate(blocks):
        block_id = f"b{i}"
        if streamer is not None and block_id in streamer.position:
            streamer.begin(block_id)
            slot = streamer._running[block_id]
            if log is not None:
                log.append(("begin", block_id, slot))
            x = block(x)
            streamer.end(block_id)
            if log is not None:
                log.append(("end", block_id, slot, streamer.slots.released[slot]))
        else:
            x = block(x)
    return x


def make(n=6, width=8):
    return [Block(width, seed=i) for i in range(n)]


def test_slots_cycle_in_order_and_never_refill_before_release():
    blocks = make(6)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    engine = RecordingEngine()
    streamed = {f"b{i}": blocks[i] for i in (1, 2, 3, 5)}
    streamer = BlockStreamer(streamed, device=torch.device("cpu"), lookahead=2,
                             pinned_budget_bytes=None, source=Source.AUTO, engine=engine)
    streamer.prepare()
    slot_ptr = {b.data_ptr(): i for i, b in enumerate(streamer.slots.buffers)}
    for _ in range(3):
        assert torch.equal(run(blocks, streamer, x, engine.log), ref)

    copies = [entry for entry in engine.log if entry[0] == "copy"]
    # steady state: one copy per streamed block per step, in circular order, round-robin slots
    assert [slot_ptr[c[1]] for c in copies] == [i % 3 for i in range(len(copies))]
    assert len(copies) == 3 * 4 + 2  # 3 steps, plus the look-ahead issued during the last
    assert [e[1] for e in engine.log if e[0] == "begin"][:5] == ["b1", "b2", "b3", "b5", "b1"]
    running: dict[int, str] = {}
    last_release: dict[int, FakeEvent] = {}
    last_ready: dict[int, FakeEvent] = {}
    previous = None
    for entry in engine.log:
        if entry[0] == "copy":
            slot = slot_ptr[entry[1]]
            assert slot not in running, "a slot was refilled while its block ran"
            # the refill waits on the event recorded when the slot's last block finished
            assert entry[2] == ((last_release[slot],) if slot in last_release else ())
            last_ready[slot] = entry[3]
        elif entry[0] == "begin":
            slot = entry[2]
            assert slot not in running
            # compute waits on the copy that filled this slot, right before the block runs
            assert previous == ("wait", last_ready[slot])
            running[slot] = entry[1]
        elif entry[0] == "end":
            del running[entry[2]]
            last_release[entry[2]] = entry[3]
        previous = entry
    assert engine.host_waits == 0 and engine.syncs == 0  # no host synchronisation


def test_compute_waits_on_the_copy_that_filled_its_slot():
    blocks = make(4)
    engine = RecordingEngine()
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(4)}, device=torch.device("cpu"),
                             lookahead=1, pinned_budget_bytes=None, source=Source.AUTO,
                             engine=engine)
    streamer.prepare()
    ready_of: dict[str, FakeEvent] = {}
    original_assign = streamer.slots.assign

    def assign(index, block_id, ready):
        ready_of[block_id] = ready
        original_assign(index, block_id, ready)

    streamer.slots.assign = assign
    waits_before_begin = []
    for _ in range(2):
        for i in range(4):
            streamer.begin(f"b{i}")
            waits_before_begin.append(engine.log[-1])
            blocks[i](torch.randn(2, 8))
            streamer.end(f"b{i}")
    assert all(entry[0] == "wait" for entry in waits_before_begin)
    assert waits_before_begin[-1][1] is ready_of["b3"]


def test_weights_live_in_a_slot_only_while_the_block_runs():
    blocks = make(3)
    streamer = BlockStreamer({"b1": blocks[1]}, device=torch.device("cpu"), lookahead=2,
                             pinned_budget_bytes=None, source=Source.AUTO)
    streamer.prepare()
    weight = blocks[1].lin.weight
    host = streamer.host["b1"].flat
    assert host.data_ptr() <= weight.data_ptr() < host.data_ptr() + host.numel()
    streamer.begin("b1")
    slot = streamer.slots.buffers[0]
    assert slot.data_ptr() <= weight.data_ptr() < slot.data_ptr() + slot.numel()
    assert blocks[1].offset.data_ptr() >= slot.data_ptr()  # buffers move too
    streamer.end("b1")
    assert host.data_ptr() <= weight.data_ptr() < host.data_ptr() + host.numel()
    assert list(blocks[1].state_dict()) == ["offset", "lin.weight", "lin.bias", "norm.weight",
                                            "norm.bias"]


def test_past_the_budget_blocks_stream_through_the_staging_ring():
    blocks = make(6)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    one_block = module_bytes(blocks[0])
    assert one_block == 5 * 256  # weight (256 B), bias, norm weight and bias, offset: aligned
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(6)}, device=torch.device("cpu"),
                             lookahead=2, pinned_budget_bytes=4 * one_block, source=Source.AUTO)
    streamer.prepare()
    stats = streamer.stats()
    # the budget pays for the 2-buffer staging ring first, then 2 blocks stay direct
    assert stats["staged_blocks"] == 4 and stats["staging_bytes"] == 2 * one_block
    assert stats["host_direct_bytes"] == 2 * one_block
    for _ in range(3):
        assert torch.equal(run(blocks, streamer, x), ref)
    assert streamer.staging.fills == 4 * 3
    streamer.close()
    assert torch.equal(run(blocks, None, x), ref)


def test_pageable_source_stages_every_block():
    blocks = make(4)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(4)}, device=torch.device("cpu"),
                             lookahead=1, pinned_budget_bytes=None, source=Source.PAGEABLE)
    streamer.prepare()
    assert streamer.stats()["staged_blocks"] == 4 and streamer.stats()["host_direct_bytes"] == 0
    for _ in range(2):
        assert torch.equal(run(blocks, streamer, x), ref)


class QuantBlock(nn.Module):
    """A block whose linear holds a real comfy-kitchen INT8 QuantizedTensor (works on CPU)."""

    def __init__(self, width: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(width, width, bias=False)
        weight = torch.randn(width, width, generator=gen)
        self.lin.weight = nn.Parameter(QuantizedTensor.from_float(weight, "TensorWiseINT8Layout"),
                                       requires_grad=False)
        self.norm = nn.RMSNorm(width)

    def forward(self, x):
        return self.norm(self.lin(x)) + x


def test_quantized_weights_move_as_raw_storage_and_scales():
    blocks = [QuantBlock(32, seed=i) for i in range(4)]
    x = torch.randn(3, 32)
    ref = run(blocks, None, x)
    qdata_before = blocks[2].lin.weight._qdata.clone()
    scale_before = blocks[2].lin.weight._params.scale.clone()
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in (1, 2, 3)},
                             device=torch.device("cpu"), lookahead=1, pinned_budget_bytes=None,
                             source=Source.AUTO)
    streamer.prepare()
    weight = blocks[2].lin.weight
    assert type(weight) is QuantizedTensor and weight._qdata.dtype == torch.int8
    streamer.begin("b2")
    slot = streamer.slots.buffers[streamer.slots.slot_of("b2")]
    for leaf in (weight._qdata, weight._params.scale):
        assert slot.data_ptr() <= leaf.data_ptr() < slot.data_ptr() + slot.numel()
    assert torch.equal(weight._qdata, qdata_before)  # never dequantized
    assert torch.equal(weight._params.scale, scale_before)
    streamer.end("b2")
    for _ in range(2):
        assert torch.equal(run(blocks, streamer, x), ref)


def test_replaced_parameters_are_copied_again():
    blocks = make(4)
    x = torch.randn(5, 8)
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(4)}, device=torch.device("cpu"),
                             lookahead=1, pinned_budget_bytes=None, source=Source.AUTO)
    streamer.prepare()
    run(blocks, streamer, x)
    # what ComfyUI does when it patches a LoRA into a weight: a new Parameter object
    new_weight = blocks[2].lin.weight.detach().clone() + 0.5
    blocks[2].lin.weight = nn.Parameter(new_weight, requires_grad=False)
    reference = [Block(8, seed=i) for i in range(4)]
    reference[2].lin.weight = nn.Parameter(new_weight.clone(), requires_grad=False)
    ref = run(reference, None, x)
    before = streamer.registrations
    streamer.prepare()
    assert streamer.registrations == before + 1
    assert torch.equal(run(blocks, streamer, x), ref)
