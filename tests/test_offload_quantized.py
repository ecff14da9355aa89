"""Streamed INT8 weights report the device they were streamed to (CPU, comfy-kitchen only).

A comfy-kitchen `QuantizedTensor` keeps the device it was built on, whatever its `_qdata`
points at; ComfyUI's cast copies a weight that is "not on the compute device" on every call.
So while a block runs from a slot on another device, its quantized weights must be wrappers
built on that device. The "other device" here is `meta` (the only second device a CPU
machine has): the slot's bytes are not real, the devices and objects are. torch refuses to
point a CPU tensor's `.data` at a meta tensor (it allows CPU <-> CUDA), so the blocks streamed
to `meta` hold quantized weights only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from comfy_kitchen.tensor.base import QuantizedTensor

from h3_multigpu.common.block_weights import BlockWeights
from h3_multigpu.offload.streamer import BlockStreamer, Source

META = torch.device("meta")


class QuantBlock(nn.Module):
    """A linear with a real comfy-kitchen INT8 weight (ConvRot), with a plain norm weight
    unless `norm=False`."""

    def __init__(self, width: int, seed: int, norm: bool = True):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(width, width, bias=False)
        weight = torch.randn(width, width, generator=gen)
        self.lin.weight = nn.Parameter(
            QuantizedTensor.from_float(weight, "TensorWiseINT8Layout", per_channel=True,
                                      convrot=True),
            requires_grad=False)
        self.norm = nn.RMSNorm(width) if norm else nn.Identity()

    def forward(self, x):
        return self.norm(self.lin(x)) + x


def streamer_on(device, blocks) -> BlockStreamer:
    streamer = BlockStreamer({f"b{i}": b for i, b in enumerate(blocks)}, device=device,
                             lookahead=1, pinned_budget_bytes=None, source=Source.AUTO)
    streamer.prepare()
    return streamer


def in_buffer(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    return flat.data_ptr() <= tensor.data_ptr() < flat.data_ptr() + flat.numel()


def test_a_running_block_holds_quantized_wrappers_on_the_slots_device():
    blocks = [QuantBlock(256, seed=i, norm=False) for i in range(3)]
    own = [b.lin.weight for b in blocks]
    streamer = streamer_on(META, blocks)
    host = streamer.host["b1"].flat
    assert blocks[1].lin.weight is own[1] and in_buffer(own[1]._qdata, host)

    streamer.begin("b1")
    running = blocks[1].lin.weight
    assert running is not own[1] and type(running) is QuantizedTensor
    assert running.device == META  # what ComfyUI's cast compares with the input's device
    assert running._qdata.device == META and running._params.scale.device == META
    assert running._qdata.dtype == torch.int8 and running.shape == own[1].shape
    assert running._layout_cls == own[1]._layout_cls
    assert running._params.convrot and running._params.orig_dtype == own[1]._params.orig_dtype
    assert isinstance(running, nn.Parameter)  # flagged as torch flags a parameter subclass
    # the module's own object stays bound to the host copy meanwhile
    assert in_buffer(own[1]._qdata, host) and own[1].device == torch.device("cpu")
    streamer.end("b1")

    assert blocks[1].lin.weight is own[1]
    slot = streamer.slots.slot_of("b1")
    streamer.begin("b1")  # still in its slot: the same wrapper, built once
    assert streamer.slots.slot_of("b1") == slot and blocks[1].lin.weight is running
    streamer.end("b1")


def test_same_device_slots_bind_in_place_and_outputs_stay_exact():
    blocks = [QuantBlock(256, seed=i) for i in range(4)]
    x = torch.randn(5, 256)
    ref = x
    for b in blocks:
        ref = b(ref)
    own = [b.lin.weight for b in blocks]
    streamer = streamer_on(torch.device("cpu"), blocks)
    for _ in range(2):
        out = x
        for i, b in enumerate(blocks):
            streamer.begin(f"b{i}")
            slot = streamer.slots.buffers[streamer.slots.slot_of(f"b{i}")]
            assert b.lin.weight is own[i] and in_buffer(own[i]._qdata, slot)
            out = b(out)
            streamer.end(f"b{i}")
        assert torch.equal(out, ref)


def test_nested_bindings_restore_in_order():
    """The sequence helper binds a block already bound to the prefetcher's slot (another
    device) to its own copy, and hands it back: each restore returns what was there."""
    block = QuantBlock(256, seed=0, norm=False)
    own = block.lin.weight
    root = BlockWeights("b0", block)
    helper = BlockWeights("b0", block)
    root_flat = torch.empty(root.nbytes, dtype=torch.uint8, device=META)
    helper_flat = torch.empty(helper.nbytes, dtype=torch.uint8)
    outer = root.swap_in(root_flat)
    on_root = block.lin.weight
    assert on_root.device == META
    inner = helper.swap_in(helper_flat)  # back on the CPU: a wrapper of the CPU
    assert block.lin.weight.device.type == "cpu" and block.lin.weight is not own
    assert in_buffer(block.lin.weight._qdata, helper_flat)
    helper.restore(inner)
    assert block.lin.weight is on_root
    root.restore(outer)
    assert block.lin.weight is own


def test_materialized_weights_are_built_on_their_new_device():
    """Putting streamed blocks back on the device for good (the prefetcher released): a
    quantized weight there is a tensor of that device, not a CPU wrapper around its bytes."""
    blocks = [QuantBlock(256, seed=i, norm=False) for i in range(3)]
    streamer = streamer_on(torch.device("cpu"), blocks)
    streamer.close(META)
    for b in blocks:
        assert b.lin.weight.device == META and b.lin.weight._qdata.device == META
