"""Dual-Sage on CPU: several fake "devices" all mapped to the CPU (streams and events no-ops)."""

import logging

import pytest
import torch

from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    ShardPlan,
    TransportMode,
    apply_dual_sage,
    parse_devices,
    parse_split,
    split_weighted,
)
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.kernels import AttentionBackend, Constraints, attention, mark_unavailable
from h3_multigpu.kernels import register as register_backend
from h3_multigpu.twin import AttentionTensorContainer, TwinPatcher

CPU = torch.device("cpu")


def strided_qkv(seq_len=37, heads=8, head_dim=16, seed=0):
    """`[1, H, S, D]` views of one `[S, 3*H*D]` buffer, exactly as the twin hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


def fake_plan(*counts):
    return ShardPlan(devices=tuple(CPU for _ in counts), head_counts=counts)


@pytest.mark.parametrize("counts", [(4, 4), (5, 3), (3, 3, 2), (1, 7), (2, 2, 2, 2)])
@pytest.mark.parametrize("transport", [TransportMode.PEER, TransportMode.HOST])
@pytest.mark.parametrize("chunk_heads,ring_slots", [(1, 1), (2, 2), (3, 2), (8, 3)])
@pytest.mark.parametrize("seq_len", [37, 64])
def test_sharded_call_is_bit_identical(counts, transport, chunk_heads, ring_slots, seq_len):
    q, k, v = strided_qkv(seq_len=seq_len)
    reference = attention(q, k, v, output="BSF")
    shard = ShardedAttention(fake_plan(*counts), transport=transport, chunk_heads=chunk_heads,
                             ring_slots=ring_slots)
    q_before = q.clone()
    out = shard(q, k, v)
    assert shard.last_route == "split"
    assert out.shape == (1, seq_len, 8 * 16)
    assert torch.equal(out, reference)
    assert torch.equal(q, q_before)  # inputs are read only
    # buffers are reused: a second call with other values is exact too
    q2, k2, v2 = strided_qkv(seq_len=seq_len, seed=5)
    assert torch.equal(shard(q2, k2, v2), attention(q2, k2, v2, output="BSF"))


def test_a_call_with_fewer_heads_is_split_by_the_same_weights():
    q, k, v = strided_qkv(heads=3)  # e.g. a head group from activation chunking
    shard = ShardedAttention(fake_plan(5, 3))
    assert shard.plan.counts_for(3) == (2, 1)
    assert shard.plan.counts_for(1) == (1, 0)
    assert torch.equal(shard(q, k, v), attention(q, k, v, output="BSF"))
    q1, k1, v1 = (t[:, :1] for t in (q, k, v))
    assert torch.equal(shard(q1, k1, v1), attention(q1, k1, v1, output="BSF"))


def test_below_min_tokens_the_call_stays_on_the_root():
    q, k, v = strided_qkv(seq_len=37)
    shard = ShardedAttention(fake_plan(4, 4), min_tokens=38)
    assert torch.equal(shard(q, k, v), attention(q, k, v, output="BSF"))
    assert shard.last_route == "root"
    q, k, v = strided_qkv(seq_len=38)
    shard(q, k, v)
    assert shard.last_route == "split"


def test_helper_failure_falls_back_exactly_and_warns_once(monkeypatch, caplog):
    sharded_module._warned.clear()
    q, k, v = strided_qkv()
    shard = ShardedAttention(fake_plan(4, 4), chunk_heads=2)

    def failing(self, backend, slot, scale):
        raise torch.OutOfMemoryError("simulated: helper out of memory")

    monkeypatch.setattr(ShardedAttention, "_helper_attention", failing)
    with caplog.at_level(logging.WARNING, logger=sharded_module.__name__):
        first = shard(q, k, v)
        second = shard(q, k, v)
    assert shard.last_route == "fallback"
    assert torch.equal(first, attention(q, k, v, output="BSF")) and torch.equal(first, second)
    warnings = [r for r in caplog.records if "helper failed" in r.getMessage()]
    assert len(warnings) == 1 and "OutOfMemoryError" in warnings[0].getMessage()
    monkeypatch.undo()  # the helper recovers: the next call splits again, exactly
    assert torch.equal(shard(q, k, v), first) and shard.last_route == "split"


class Interrupted(Exception):
    """Stands in for ComfyUI's InterruptProcessingException."""


def test_an_exception_mid_call_leaves_reusable_buffers():
    calls = {"root": 0}

    def interrupted_once(q, k, v, *, scale=None):
        if q.shape[1] == 4:  # the root's own four heads (helper chunks carry two)
            calls["root"] += 1
            if calls["root"] == 1:
                raise Interrupted()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    register_backend(AttentionBackend(
        name="test_interrupting", fn=interrupted_once, deterministic=True, description="test",
        constraints=Constraints(dtypes=frozenset({torch.float32}),
                                device_types=frozenset({"cpu"}))))
    try:
        q, k, v = strided_qkv()
        shard = ShardedAttention(fake_plan(4, 4), backend="test_interrupting", chunk_heads=2)
        with pytest.raises(Interrupted):
            shard(q, k, v)
        q2, k2, v2 = strided_qkv(seed=3)
        assert torch.equal(shard(q2, k2, v2), attention(q2, k2, v2, output="BSF"))
    finally:
        mark_unavailable("test_interrupting", "test finished")


def test_split_strings():
    assert parse_split("auto", 56, 2) == (28, 28)
    assert parse_split("32:24", 56, 2) == (32, 24)
    assert parse_split("1.0:0.75", 56, 2) == (32, 24)
    assert parse_split("auto", 56, 3) == (19, 19, 18)
    assert split_weighted(8, [5, 3]) == (5, 3)
    assert split_weighted(4, [100, 1, 1]) == (2, 1, 1)  # nobody is left at zero


@pytest.mark.parametrize("text,message", [
    ("28:27", "sums to 55"),
    ("0:56", "no heads"),
    ("28:-28", "no heads"),
    ("a:b", "not a list of numbers"),
    ("28:14:14", "3 entries for 2 devices"),
])
def test_bad_split_strings_raise(text, message):
    with pytest.raises(ValueError, match=message):
        parse_split(text, 56, 2)


def test_bad_devices_raise():
    with pytest.raises(ValueError, match="not a device"):
        parse_devices("gpu:x")
    assert parse_devices("gpu:0, 2") == (torch.device("cuda", 0), torch.device("cuda", 2))
    with pytest.raises(ValueError, match="no heads"):
        ShardPlan(devices=(CPU, CPU), head_counts=(8, 0))
    with pytest.raises(ValueError, match="twice"):
        ShardPlan(devices=(torch.device("cuda", 1), torch.device("cuda", 1)),
                  head_counts=(4, 4))


def test_config_from_strings_validates():
    config = DualSageConfig.from_strings(helpers="gpu:0", split="28:28", backend="sdpa",
                                         min_tokens="8192", transport="host")
    assert config.helpers == ("cuda:0",) and config.min_tokens == 8192
    assert config.transport is TransportMode.HOST
    with pytest.raises(ValueError, match="transport 'nvlink'"):
        DualSageConfig(transport="nvlink")
    with pytest.raises(ValueError, match="backend 'fastest'"):
        DualSageConfig(backend="fastest")
    with pytest.raises(ValueError, match="min_tokens 'lots'"):
        DualSageConfig.from_strings(min_tokens="lots")


def test_unknown_gpu_is_refused_before_anything_runs(tiny_twin):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    patcher = TwinPatcher(tiny_twin, load_device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        apply_dual_sage(patcher, DualSageConfig(helpers=(f"cuda:{count + 3}",)))
    with pytest.raises(ValueError, match="sums to 7"):
        apply_dual_sage(patcher, DualSageConfig(helpers=("cpu",), split="4:3"))


def apply_on_cpu(patcher, **options):
    return apply_dual_sage(patcher, DualSageConfig(helpers=options.pop("helpers", ("cpu",)),
                                                   min_tokens=options.pop("min_tokens", 0),
                                                   **options))


def shard_of(patcher):
    return patcher.model_options["transformer_options"]["optimized_attention_override"].sharded


@pytest.mark.parametrize("helpers,split", [(("cpu",), "auto"), (("cpu",), "5:3"),
                                           (("cpu", "cpu"), "3:3:2")])
def test_twin_output_is_bit_identical(tiny_twin, tiny_inputs, helpers, split):
    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    base = TwinPatcher(tiny_twin)
    patched = apply_on_cpu(base, helpers=helpers, split=split, chunk_heads=2, ring_slots=2)
    splits = []
    shard = shard_of(patched)
    original = shard._split
    shard._split = lambda *a: splits.append(a[1].shape[2]) or original(*a)
    out = patched.apply_model(*tiny_inputs)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    assert splits == [16, 44, 44, 44]  # refiner (text only) then the three blocks
    status = patched.model_options["transformer_options"]["h3_multigpu"]["dual_sage"]
    assert "Dual-Sage on" in status and "sdpa" in status
    assert "h3_multigpu" not in base.model_options["transformer_options"]  # parent untouched


def test_twin_min_tokens_keeps_short_calls_on_the_root(tiny_twin, tiny_inputs):
    patched = apply_on_cpu(TwinPatcher(tiny_twin), min_tokens=20)
    shard = shard_of(patched)
    routes = []
    original = shard.__call__

    class Spy:
        def __call__(self, q, k, v, **kw):
            out = original(q, k, v, **kw)
            routes.append(shard.last_route)
            return out

    patched.model_options["transformer_options"]["optimized_attention_override"].sharded = Spy()
    out = patched.apply_model(*tiny_inputs)
    assert routes == ["root", "split", "split", "split"]
    assert torch.equal(out[0], TwinPatcher(tiny_twin).apply_model(*tiny_inputs)[0])


def test_existing_override_is_chained_and_keeps_priority(tiny_twin, tiny_inputs):
    seen = []

    def logging_override(func, q, k, v, heads, **kwargs):
        seen.append((q.shape[2], heads, kwargs.get("skip_reshape")))
        return func(q, k, v, heads, **kwargs)

    base = TwinPatcher(tiny_twin).clone()
    base.set_model_optimized_attention(logging_override)
    patched = apply_on_cpu(base)
    out = patched.apply_model(*tiny_inputs)
    assert seen == [(16, 8, True), (44, 8, True), (44, 8, True), (44, 8, True)]
    assert shard_of(patched).last_route == "split"
    assert torch.equal(out[0], TwinPatcher(tiny_twin).apply_model(*tiny_inputs)[0])
    assert "chained" in patched.model_options["transformer_options"]["h3_multigpu"]["dual_sage"]


def test_override_handles_containers_layouts_and_unknown_kwargs(tiny_twin):
    patched = apply_on_cpu(TwinPatcher(tiny_twin))
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    q, k, v = strided_qkv()
    reference = attention(q, k, v, output="BSF")
    received = {}

    def comfy_func(q, k, v, heads, **kwargs):
        received.update(kwargs)
        return "comfy"

    wrapped = [AttentionTensorContainer(t) for t in (q, k, v)]
    out = override(comfy_func, *wrapped, 8, mask=None, skip_reshape=True,
                   transformer_options={}, preferred_attention=None, some_future_flag=1)
    assert torch.equal(out, reference) and received == {}
    out_BHSD = override(comfy_func, q, k, v, 8, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out_BHSD, attention(q, k, v))
    # a masked call or the [B, S, H*D] layout goes to ComfyUI's function with every kwarg
    mask = torch.zeros(37, 37)
    assert override(comfy_func, q, k, v, 8, mask=mask, skip_reshape=True, extra=2) == "comfy"
    assert received["extra"] == 2 and received["mask"] is mask


def test_composes_with_head_group_chunking_in_either_order(tiny_twin, tiny_inputs):
    chunking = pytest.importorskip("h3_multigpu.chunking")
    config = chunking.ChunkingConfig(head_group=3, qkv_chunk=16, ffn_chunk=16)
    chunked = chunking.apply_activation_chunking(TwinPatcher(tiny_twin), config)
    reference = chunked.apply_model(*tiny_inputs)
    heads_seen = []
    for patched in (apply_on_cpu(chunked),
                    chunking.apply_activation_chunking(apply_on_cpu(TwinPatcher(tiny_twin)),
                                                       config)):
        shard = shard_of(patched)
        original = shard._split
        shard._split = lambda *a, o=original: heads_seen.append(a[1].shape[1]) or o(*a)
        out = patched.apply_model(*tiny_inputs)
        assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
    assert 3 in heads_seen and 2 in heads_seen  # groups of 3 heads (and the last group of 2)
