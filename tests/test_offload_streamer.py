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

from h3_multigpu.common.block_weights import module_bytes
from h3_multigpu.offload.streamer import BlockStreamer, Source


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


def test_prologue_streams_once_and_step_boundaries_prefetch_the_cycle():
    """The token refiner (prologue) runs once per sampling run before the DiT steps: it leads
    into the cycle, and the cycle's look-ahead never wraps back into it."""
    blocks = {f"b{i}": block for i, block in enumerate(make(6))}
    x = torch.randn(5, 8)
    streamer = BlockStreamer(blocks, device=torch.device("cpu"), lookahead=2,
                             pinned_budget_bytes=None, source=Source.AUTO, prologue=["b0", "b1"])
    assert streamer.cycle == ["b2", "b3", "b4", "b5"] and streamer.prologue == ["b0", "b1"]
    assert list(streamer.following("b1")) == ["b2", "b3", "b4", "b5"]
    assert list(streamer.following("b5")) == ["b2", "b3", "b4"]

    def run_ids(ids, h, stream):
        for block_id in ids:
            if stream:
                streamer.begin(block_id)
            h = blocks[block_id](h)
            if stream:
                streamer.end(block_id)
        return h

    cycle = ["b2", "b3", "b4", "b5"]
    ref_prologue = run_ids(["b0", "b1"], x, False)
    ref_step = run_ids(cycle, ref_prologue, False)
    streamer.prepare()
    h = run_ids(["b0", "b1"], x, True)
    assert torch.equal(h, ref_prologue)
    for _ in range(3):  # three steps
        assert torch.equal(run_ids(cycle, h, True), ref_step)
        assert set(streamer.slots.holder) <= set(cycle)
    assert streamer.copies["b0"] == streamer.copies["b1"] == 1
    assert all(streamer.copies[b] >= 3 for b in cycle)


def test_a_backup_of_a_bound_tensor_keeps_its_bytes():
    """ComfyUI backs a weight up with `weight.to(offload_device, copy=False)`: for a weight
    bound to its host copy that is the bound object itself. Re-copying the host copy must not
    change the backup."""
    blocks = make(3)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    streamer = BlockStreamer({"b1": blocks[1]}, device=torch.device("cpu"), lookahead=1,
                             pinned_budget_bytes=None, source=Source.AUTO)
    streamer.prepare()
    backup = blocks[1].lin.weight  # the bound object, as ComfyUI's backup holds it
    original = backup.detach().clone()
    blocks[1].lin.weight = nn.Parameter(original * 2.0, requires_grad=False)  # LoRA patch
    streamer.prepare()
    assert torch.equal(backup, original) and streamer.detached_backups == 1
    assert not torch.equal(run(blocks, streamer, x), ref)
    blocks[1].lin.weight = nn.Parameter(backup, requires_grad=False)  # ComfyUI unpatches
    streamer.prepare()
    assert torch.equal(run(blocks, streamer, x), ref)


def test_adopt_puts_a_replaced_tensor_into_the_host_copy():
    blocks = make(3)
    streamer = BlockStreamer({"b1": blocks[1]}, device=torch.device("cpu"), lookahead=1,
                             pinned_budget_bytes=None, source=Source.AUTO)
    streamer.prepare()
    host = streamer.host["b1"].flat
    backup = blocks[1].lin.weight
    original = backup.detach().clone()
    blocks[1].lin.weight = nn.Parameter(original + 1.0, requires_grad=False)
    before = streamer.registrations
    assert streamer.adopt("b1", blocks[1].lin, "weight")
    weight = blocks[1].lin.weight
    assert host.data_ptr() <= weight.data_ptr() < host.data_ptr() + host.numel()
    assert torch.equal(weight, original + 1.0) and torch.equal(backup, original)
    assert streamer.registrations == before + 1
    assert streamer.weights["b1"].is_bound_to(host)
    assert not streamer.adopt("b1", blocks[0].lin, "weight")  # not a tensor of this block


def test_unpin_and_repin_in_place(monkeypatch):
    from h3_multigpu.common import arena

    locked: set[int] = set()
    monkeypatch.setattr(arena, "pin_host", lambda r: (locked.add(r.data_ptr()) or True, False))
    monkeypatch.setattr(arena, "unpin_host", lambda r, booked: locked.discard(r.data_ptr()))
    blocks = make(4)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in (1, 2, 3)},
                             device=torch.device("cpu"), lookahead=1, pinned_budget_bytes=None,
                             source=Source.AUTO, can_pin=True)
    streamer.prepare()
    pinned = streamer.stats()["pinned_bytes"]
    assert pinned == 3 * module_bytes(blocks[0]) and len(locked) == 3
    pointers = [streamer.host[b].flat.data_ptr() for b in ("b1", "b2", "b3")]
    streamer.unpin()  # ComfyUI unloaded the model
    assert not locked and streamer.stats()["pinned_bytes"] == 0 and streamer.slots is None
    assert [streamer.host[b].flat.data_ptr() for b in ("b1", "b2", "b3")] == pointers
    streamer.prepare()  # the next run locks the same pages again
    assert len(locked) == 3 and streamer.stats()["pinned_bytes"] == pinned
    assert torch.equal(run(blocks, streamer, x), ref)


def test_a_failed_registration_leaves_the_weights_and_can_be_retried(monkeypatch):
    from h3_multigpu.common.arena import HostArena

    blocks = make(4)
    x = torch.randn(5, 8)
    ref = run(blocks, None, x)
    before = [p.detach().clone() for b in blocks for p in b.parameters()]
    streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(4)}, device=torch.device("cpu"),
                             lookahead=1, pinned_budget_bytes=None, source=Source.AUTO)
    original, calls = HostArena.allocate, []

    def failing(self, nbytes, want_direct):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return original(self, nbytes, want_direct)

    monkeypatch.setattr(HostArena, "allocate", failing)
    try:
        streamer.prepare()
    except MemoryError:
        pass
    assert not streamer.prepared and streamer.host == {}
    after = [p for b in blocks for p in b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    streamer.prepare()
    assert streamer.prepared and torch.equal(run(blocks, streamer, x), ref)


def test_arena_split_is_what_the_streamer_does():
    from h3_multigpu.offload import sizing

    blocks = make(6)
    one = module_bytes(blocks[0])
    for budget_blocks, source in [(None, "auto"), (6, "auto"), (5, "auto"), (4, "auto"),
                                  (1, "auto"), (2, "pinned"), (None, "pageable")]:
        budget = None if budget_blocks is None else budget_blocks * one
        streamer = BlockStreamer({f"b{i}": blocks[i] for i in range(6)},
                                 device=torch.device("cpu"), lookahead=1,
                                 pinned_budget_bytes=budget, source=Source(source))
        streamer.prepare()
        split = sizing.arena_split([one] * 6, budget, source=source)
        stats = streamer.stats()
        assert stats["staged_blocks"] == split.staged_blocks, (budget_blocks, source)
        assert stats["host_direct_bytes"] == split.direct_bytes
        assert stats["staging_bytes"] == split.staging_bytes
        streamer.close()
