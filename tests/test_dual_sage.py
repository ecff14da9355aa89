"""Dual-Sage on CPU: several fake "devices" all mapped to the CPU.

Streams are no-ops in most tests; the `simulate()` tests run every stream as a lazily drained
queue so a missing wait shows as wrong numbers (see `exchange.streams`).
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from twin import AttentionTensorContainer, TwinPatcher

from h3_multigpu import chunking
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.devices import parse_devices
from h3_multigpu.common.exactness import ExactRange, derive_per_sm
from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    ShardPlan,
    TransportMode,
    apply_dual_sage,
    parse_split,
    split_weighted,
)
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.kernels import AttentionBackend, Constraints, mark_unavailable
from h3_multigpu.kernels import register as register_backend

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("two_cpu_threads")


@pytest.fixture
def one_thread(two_cpu_threads):
    """For the mechanism tests that split down to 1-head subsets without an exact range:
    those are exact on the CPU only single-threaded (measured: `exact_range.json` "cpu")."""
    torch.set_num_threads(1)


def strided_qkv(seq_len=37, heads=8, head_dim=16, seed=0):
    """`[1, H, S, D]` views of one `[S, 3*H*D]` buffer, exactly as the twin hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


class CountingAttend:
    """attend(q, k, v) -> [1, h, S, D] by SDPA, counting calls and the heads of each."""

    def __init__(self):
        self.heads: list[int] = []

    def __call__(self, q, k, v):
        self.heads.append(q.shape[1])
        return F.scaled_dot_product_attention(q, k, v)


def reference(q, k, v):
    b, h, s, d = q.shape
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h * d)


def fake_plan(*counts):
    return ShardPlan(devices=tuple(CPU for _ in counts), head_counts=counts)


@pytest.mark.parametrize("counts", [(4, 4), (5, 3), (3, 3, 2), (1, 7), (2, 2, 2, 2)])
@pytest.mark.parametrize("transport", [TransportMode.PEER, TransportMode.HOST])
@pytest.mark.parametrize("chunk_heads,ring_slots", [(1, 1), (2, 2), (3, 2), (8, 3)])
@pytest.mark.parametrize("seq_len", [37, 64])
def test_sharded_call_is_bit_identical(counts, transport, chunk_heads, ring_slots, seq_len,
                                       one_thread):
    q, k, v = strided_qkv(seq_len=seq_len)
    shard = ShardedAttention(fake_plan(*counts), transport=transport, chunk_heads=chunk_heads,
                             ring_slots=ring_slots)
    q_before = q.clone()
    attend = CountingAttend()
    out = shard(q, k, v, attend)
    assert shard.last_route == "split"
    assert out.shape == (1, seq_len, 8 * 16)
    assert torch.equal(out, reference(q, k, v))
    assert torch.equal(q, q_before)  # inputs are read only
    # the function ran once on the root's heads and once per helper chunk, nothing more
    helper_chunks = [min(chunk_heads, c - a) for c in counts[1:] for a in range(0, c, chunk_heads)]
    assert attend.heads == [counts[0], *helper_chunks]
    # buffers are reused: a second call with other values is exact too
    q2, k2, v2 = strided_qkv(seq_len=seq_len, seed=5)
    assert torch.equal(shard(q2, k2, v2, attend), reference(q2, k2, v2))
    assert shard.workspace_allocations == len(counts) - 1


def test_a_call_with_fewer_heads_is_split_by_the_same_weights(one_thread):
    q, k, v = strided_qkv(heads=3)  # e.g. a head group from activation chunking
    shard = ShardedAttention(fake_plan(5, 3))
    assert shard.plan.counts_for(3) == (2, 1)
    assert shard.plan.counts_for(1) == (1, 0)
    assert torch.equal(shard(q, k, v, CountingAttend()), reference(q, k, v))
    q1, k1, v1 = (t[:, :1] for t in (q, k, v))
    assert torch.equal(shard(q1, k1, v1, CountingAttend()), reference(q1, k1, v1))


def test_uneven_head_groups_reuse_one_workspace(one_thread):
    """Chunking's head groups (3, 3, 2 of 8 heads here; 16, 16, 16, 8 on H3) fit the buffers
    of the largest group: one allocation per helper for every block, not two per block."""
    q, k, v = strided_qkv(heads=8, seq_len=40)
    shard = ShardedAttention(fake_plan(2, 6), chunk_heads=1, ring_slots=2)
    assert [shard.plan.counts_for(h)[1] for h in (3, 2)] == [2, 1]  # uneven helper shares
    for _block in range(3):
        for h0, h1 in ((0, 3), (3, 6), (6, 8)):
            group = tuple(t[:, h0:h1] for t in (q, k, v))
            assert torch.equal(shard(*group, CountingAttend()), reference(*group))
    assert shard.routes["split"] == 9 and shard.workspace_allocations == 1
    # a longer call grows the buffers once; shorter ones reuse them
    q2, k2, v2 = strided_qkv(heads=8, seq_len=64, seed=2)
    shard(q2, k2, v2, CountingAttend())
    shard(q, k, v, CountingAttend())
    assert shard.workspace_allocations == 2


def test_below_min_tokens_the_call_stays_on_the_root():
    q, k, v = strided_qkv(seq_len=37)
    shard = ShardedAttention(fake_plan(4, 4), min_tokens=38)
    attend = CountingAttend()
    assert torch.equal(shard(q, k, v, attend), reference(q, k, v))
    assert shard.last_route == "root" and attend.heads == [8]
    q, k, v = strided_qkv(seq_len=38)
    shard(q, k, v, attend)
    assert shard.last_route == "split"


class StubRange:
    """An exact range with fixed answers per device kind (CPU stands in for both GPUs here)."""

    def __init__(self, root_need, helper_need):
        self.needs = [root_need, helper_need]

    def min_heads(self, device, seq_len, dtype, head_dim):
        return self.needs.pop(0) if len(self.needs) > 1 else self.needs[0]


def test_helper_chunks_grow_to_the_exact_range_and_calls_outside_it_stay_whole():
    q, k, v = strided_qkv(heads=8)
    # helpers need >= 3 heads per call: no chunk of 1, not even the last (4 = 3 + 1 would
    # leave one): one chunk of 4; the root's 4 heads are enough
    shard = ShardedAttention(fake_plan(4, 4), chunk_heads=1, exact_range=StubRange(2, 3))
    attend = CountingAttend()
    assert torch.equal(shard(q, k, v, attend), reference(q, k, v))
    assert attend.heads == [4, 4]
    shard = ShardedAttention(fake_plan(2, 6), chunk_heads=1, exact_range=StubRange(2, 3))
    attend = CountingAttend()
    assert torch.equal(shard(q, k, v, attend), reference(q, k, v))
    assert attend.heads == [2, 3, 3]
    # a subset below the range stays whole on the root: no gather, no helper
    for need in ((5, 1), (1, 5), (None, 1)):
        shard = ShardedAttention(fake_plan(4, 4), exact_range=StubRange(*need))
        attend = CountingAttend()
        assert torch.equal(shard(q, k, v, attend), reference(q, k, v))
        assert shard.last_route == "inexact" and attend.heads == [8]
        assert shard.workspace_allocations == 0


def test_exact_range_threshold_from_a_sweep():
    cases = [dict(heads=h, seq_len=s, sms=132, exact=h * -(-s // 64) >= 211.2)
             for s in (3320, 4096, 15399) for h in (1, 2, 4, 8, 14, 28, 56)]
    per_sm = derive_per_sm(cases)
    # every case above the largest inexact one (4 heads x 3320) is exact: 1 head x 15,399
    assert per_sm == round(15399 / 132, 1)
    rng = ExactRange(per_sm={"flash": per_sm, "math": None})
    # the CPU: 2 heads with more than one thread (a 1-head call differs in fp32), 1 with one
    assert rng.min_heads(CPU, 3320, torch.float32, 128) == 2
    torch.set_num_threads(1)
    assert rng.min_heads(CPU, 3320, torch.float32, 128) == 1
    assert rng.min_heads(torch.device("mps"), 3320, torch.float32, 128) is None  # not measured
    assert derive_per_sm([dict(heads=56, seq_len=4096, sms=132, exact=False)]) is None
    shipped = ExactRange.load()
    assert set(shipped.per_sm) >= {"flash", "cudnn", "efficient", "math"}


def test_helper_failure_falls_back_exactly_warns_once_and_is_remembered(monkeypatch, caplog):
    sharded_module._warned.clear()
    q, k, v = strided_qkv()
    shard = ShardedAttention(fake_plan(4, 4), chunk_heads=2)
    attempts = []

    def failing(self, attend, slot):
        attempts.append(slot.shape)
        raise torch.OutOfMemoryError("simulated: helper out of memory")

    monkeypatch.setattr(ShardedAttention, "_helper_attention", failing)
    attend = CountingAttend()
    with caplog.at_level(logging.WARNING, logger=sharded_module.__name__):
        first = shard(q, k, v, attend)
        second = shard(q, k, v, attend)
        third = shard(q, k, v, attend)
    assert shard.last_route == "fallback" and shard.routes["fallback"] == 3
    assert torch.equal(first, reference(q, k, v)) and torch.equal(first, second)
    assert torch.equal(first, third)
    warnings = [r for r in caplog.records if "helper failed" in r.getMessage()]
    assert len(warnings) == 1 and "OutOfMemoryError" in warnings[0].getMessage()
    # remembered for this call shape: later calls neither gather, allocate nor fail again
    assert len(attempts) == 1 and shard.workspace_allocations == 1
    assert attend.heads == [4, 8, 8, 8]  # root share of the failed split, then three fallbacks
    assert shard.workspace_bytes() == 0  # the failed call's buffers were handed back
    monkeypatch.undo()  # the helper recovers: the shape retries after ComfyUI's cleanup
    shard(q, k, v, attend)
    assert shard.last_route == "fallback"
    shard.release()
    assert torch.equal(shard(q, k, v, attend), first) and shard.last_route == "split"


class Interrupted(Exception):
    """Stands in for ComfyUI's InterruptProcessingException."""


def test_an_exception_mid_call_leaves_reusable_buffers():
    calls = {"root": 0}

    def interrupted_once(q, k, v):
        if q.shape[1] == 4:  # the root's own four heads (helper chunks carry two)
            calls["root"] += 1
            if calls["root"] == 1:
                raise Interrupted()
        return F.scaled_dot_product_attention(q, k, v)

    q, k, v = strided_qkv()
    shard = ShardedAttention(fake_plan(4, 4), chunk_heads=2)
    with pytest.raises(Interrupted):
        shard(q, k, v, interrupted_once)
    q2, k2, v2 = strided_qkv(seed=3)
    assert torch.equal(shard(q2, k2, v2, interrupted_once), reference(q2, k2, v2))


def test_release_frees_every_workspace():
    q, k, v = strided_qkv()
    shard = ShardedAttention(fake_plan(3, 3, 2), chunk_heads=2, transport=TransportMode.HOST)
    shard(q, k, v, CountingAttend())
    assert shard.workspace_bytes() > 0
    shard.release()
    assert shard.workspace_bytes() == 0
    assert torch.equal(shard(q, k, v, CountingAttend()), reference(q, k, v))


# ---------------------------------------------------------------------- strings and devices
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
    assert DualSageConfig().backend == "comfyui" and DualSageConfig().exact_only
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


# ---------------------------------------------------------------------- on the twin
def apply_on_cpu(patcher, **options):
    return apply_dual_sage(patcher, DualSageConfig(helpers=options.pop("helpers", ("cpu",)),
                                                   min_tokens=options.pop("min_tokens", 0),
                                                   **options))


def override_of(patcher):
    return patcher.model_options["transformer_options"]["optimized_attention_override"]


def shard_of(patcher):
    """Dual-Sage's sharded attention, wherever its override sits in the chain."""
    override = override_of(patcher)
    while not hasattr(override, "sharded"):
        override = override.previous  # another feature's override chained around it
    return override.sharded


@pytest.mark.parametrize("helpers,split", [(("cpu",), "auto"), (("cpu",), "5:3"),
                                           (("cpu", "cpu"), "3:3:2")])
def test_twin_output_is_bit_identical(tiny_twin, tiny_inputs, helpers, split):
    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    base = TwinPatcher(tiny_twin)
    patched = apply_on_cpu(base, helpers=helpers, split=split, chunk_heads=2, ring_slots=2)
    out = patched.apply_model(*tiny_inputs)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    assert shard_of(patched).routes["split"] == 4  # the twin's refiner, then three blocks
    status = protocol.status_lines(patched)["dual_sage"]
    assert "Dual-Sage on" in status and "ComfyUI's attention" in status
    assert "exact" in status
    assert "h3_multigpu" not in base.model_options["transformer_options"]  # parent untouched


def test_twin_min_tokens_keeps_short_calls_on_the_root(tiny_twin, tiny_inputs):
    patched = apply_on_cpu(TwinPatcher(tiny_twin), min_tokens=20)
    out = patched.apply_model(*tiny_inputs)
    assert dict(shard_of(patched).routes) == {"root": 1, "split": 3}
    assert torch.equal(out[0], TwinPatcher(tiny_twin).apply_model(*tiny_inputs)[0])


def test_the_function_comfyui_would_run_is_sharded(tiny_twin, tiny_inputs):
    """The twin's preferred attention (a checkpoint's comfy_attention choice) runs per head
    subset under Dual-Sage, as it runs per call unpatched; never the pack's own SDPA."""
    from twin import attention as twin_attention

    calls = []

    @twin_attention.wrap_attn  # as ComfyUI's own functions: takes containers or tensors
    def preferred(q, k, v, heads, **kwargs):
        calls.append(heads)
        return twin_attention.attention_pytorch(q, k, v, heads, **kwargs) * 1.5

    modules = [m for m in tiny_twin.modules() if hasattr(m, "comfy_attention")]
    for m in modules:
        m.comfy_attention.function = preferred
    try:
        plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
        unpatched_calls = list(calls)
        calls.clear()
        patched = apply_on_cpu(TwinPatcher(tiny_twin), split="5:3")
        out = patched.apply_model(*tiny_inputs)
    finally:
        for m in modules:
            m.comfy_attention.function = None
    assert unpatched_calls == [8] * 4
    assert calls == [5, 3] * 4  # root heads, helper chunk (chunk_heads 4 > 3), per call
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])


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
    assert shard_of(patched).routes["split"] == 4
    assert torch.equal(out[0], TwinPatcher(tiny_twin).apply_model(*tiny_inputs)[0])
    assert "chained" in protocol.status_lines(patched)["dual_sage"]


def test_override_handles_containers_layouts_and_unknown_kwargs(tiny_twin):
    patched = apply_on_cpu(TwinPatcher(tiny_twin))
    override = override_of(patched)
    q, k, v = strided_qkv()
    received = []

    def comfy_func(q, k, v, heads, **kwargs):
        received.append((heads, dict(kwargs)))
        if kwargs.get("mask") is not None:
            return "comfy"
        out = F.scaled_dot_product_attention(q, k, v)
        if kwargs.get("skip_output_reshape"):
            return out
        return out.transpose(1, 2).reshape(1, q.shape[2], heads * q.shape[3])

    wrapped = [AttentionTensorContainer(t) for t in (q, k, v)]
    out = override(comfy_func, *wrapped, 8, mask=None, skip_reshape=True,
                   transformer_options={}, some_future_flag=1)
    assert torch.equal(out, reference(q, k, v))
    # every subset call got the call's own keywords
    assert [h for h, _ in received] == [4, 4]
    assert all(kw["some_future_flag"] == 1 and kw["skip_reshape"] for _, kw in received)
    out_BHSD = override(comfy_func, q, k, v, 8, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out_BHSD, F.scaled_dot_product_attention(q, k, v))
    # a masked call or the [B, S, H*D] layout goes to ComfyUI's function with every kwarg
    mask = torch.zeros(37, 37)
    received.clear()
    assert override(comfy_func, q, k, v, 8, mask=mask, skip_reshape=True, extra=2) == "comfy"
    assert received[0][1]["extra"] == 2 and received[0][1]["mask"] is mask


def test_clones_share_one_runtime(tiny_twin, tiny_inputs):
    import copy

    patched = apply_on_cpu(TwinPatcher(tiny_twin))
    patched.apply_model(*tiny_inputs)
    options = copy.deepcopy(patched.model_options)  # what ComfyUI's clone() does
    assert options["transformer_options"]["optimized_attention_override"] is override_of(patched)


@pytest.mark.parametrize("threads", [1, 2])
def test_composes_with_head_group_chunking_in_either_order(tiny_twin, tiny_inputs, threads):
    torch.set_num_threads(threads)
    config = chunking.ChunkingConfig(head_group=3, qkv_chunk=16, ffn_chunk=16)
    chunked = chunking.apply_activation_chunking(TwinPatcher(tiny_twin), config)
    reference_out = chunked.apply_model(*tiny_inputs)
    for patched in (apply_on_cpu(chunked),
                    chunking.apply_activation_chunking(apply_on_cpu(TwinPatcher(tiny_twin)),
                                                       config)):
        out = patched.apply_model(*tiny_inputs)
        assert torch.equal(out[0], reference_out[0]) and torch.equal(out[1], reference_out[1])
        shard = shard_of(patched)
        # refiner whole (8 heads, 4:4) + three blocks of head groups 3, 3, 2 (2:1, 2:1, 1:1):
        # with one thread all split, sharing the largest group's buffers; with two a 1-head
        # subset is not known exact, so those groups stay whole on the root
        if threads == 1:
            assert shard.routes["split"] == 10 and shard.workspace_allocations <= 2
        else:
            assert dict(shard.routes) == {"split": 1, "inexact": 9}


# ---------------------------------------------------------------------- SageAttention node
@pytest.fixture
def counting_backend():
    calls = []

    def run(q, k, v, *, scale=None):
        calls.append(q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    register_backend(AttentionBackend(
        name="test_counting", fn=run, deterministic=True, description="test",
        constraints=Constraints(dtypes=frozenset({torch.float32}),
                                device_types=frozenset({"cpu"}))))
    yield calls
    mark_unavailable("test_counting", "test finished")


@pytest.mark.parametrize("order", ["sage_first", "dual_sage_first"])
def test_sage_node_and_dual_sage_compose_in_either_order(tiny_twin, tiny_inputs, order,
                                                         counting_backend):
    from h3_multigpu.nodes.attention_override import apply_backend_override

    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    base = TwinPatcher(tiny_twin)
    if order == "sage_first":
        patched = apply_on_cpu(apply_backend_override(base, "test_counting"), split="5:3")
        shard = shard_of(patched)
    else:
        dual = apply_on_cpu(base, split="5:3")
        shard = shard_of(dual)
        patched = apply_backend_override(dual, "test_counting")
    out = patched.apply_model(*tiny_inputs)
    # the chosen backend ran on every head subset of every call, and every call was split
    assert counting_backend == [5, 3] * 4
    assert shard.routes["split"] == 4
    # the counting backend is SDPA itself: the same bits as the plain twin
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    lines = protocol.status_lines(patched)
    assert "test_counting" in lines["dual_sage"] and "test_counting" in lines["attention"]


@pytest.mark.parametrize("transport", [TransportMode.PEER, TransportMode.HOST])
def test_workspace_made_under_inference_mode_serves_calls_outside_it(transport):
    """ComfyUI executes nodes under inference mode; the cached workspace (and its pinned relay
    slots) made by that first call is written in place by later calls under either mode."""
    shard = ShardedAttention(fake_plan(4, 4), transport=transport, chunk_heads=2, ring_slots=2)
    for seed, mode in enumerate([torch.inference_mode, torch.no_grad, torch.inference_mode]):
        q, k, v = strided_qkv(seed=seed)
        with mode():
            out = shard(q, k, v, CountingAttend())
        assert shard.last_route == "split" and torch.equal(out, reference(q, k, v))
    assert shard.workspace_allocations == 1  # one workspace served all three


@pytest.mark.parametrize("transport,chunk_heads,expected", [
    ("host", None, 4), ("peer", None, 14), ("peer", 2, 2), ("host", 7, 7)])
def test_chunk_heads_follow_the_transport_unless_set(tiny_twin, tiny_inputs, transport,
                                                     chunk_heads, expected):
    """Measured on 2x H200: 14-head chunks are fastest over peer copies, 4 through the relay."""
    options = {} if chunk_heads is None else {"chunk_heads": chunk_heads}
    patched = apply_on_cpu(TwinPatcher(tiny_twin), transport=transport, **options)
    shard = shard_of(patched)
    assert shard.chunk_heads == expected
    out = patched.apply_model(*tiny_inputs)
    assert torch.equal(out[0], TwinPatcher(tiny_twin).apply_model(*tiny_inputs)[0])
    assert shard.routes["split"] > 0


def test_the_planner_sizes_the_helper_ring_by_its_link():
    from h3_multigpu.planner.sizing import dual_sage_helper_workspace

    peer = dual_sage_helper_workspace(68_706, 28, host_relay=False)
    host = dual_sage_helper_workspace(68_706, 28, host_relay=True)
    # 2 slots of 14 heads against 3 slots of 4 heads (q|k|v each) plus one chunk's output
    assert peer > 2 * host


@pytest.mark.parametrize("transport", ["peer", "host"])
def test_four_devices_with_mixed_head_shares_are_bit_identical(transport):
    """H3's 56 heads as 20:12:12:12 (root first) over a root and three helpers."""
    from twin import TwinConfig, make_inputs, make_twin

    cfg = TwinConfig.tiny(heads=56)
    model = make_twin(cfg, seed=0)
    inputs = make_inputs(cfg, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)
    plain = TwinPatcher(model).apply_model(*inputs)
    patched = apply_on_cpu(TwinPatcher(model), helpers=("cpu",) * 3, split="20:12:12:12",
                           transport=transport)
    out = patched.apply_model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, plain, strict=True))
    shard = shard_of(patched)
    assert shard.plan.head_counts == (20, 12, 12, 12) and shard.routes["split"] > 0
