"""Dual-Sage on two real GPUs: root cuda:1 (as in production), helper cuda:0."""

import logging

import pytest
import torch
import torch.nn.functional as F

from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    ShardPlan,
    TransportMode,
    apply_dual_sage,
    sizing,
)
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.kernels import attention, list_backends
from h3_multigpu.twin import TwinConfig, TwinPatcher, make_inputs, make_twin

pytestmark = pytest.mark.multi_gpu
ROOT, HELPER = torch.device("cuda", 1), torch.device("cuda", 0)


def h3_qkv(seq_len, heads=56, head_dim=128, seed=0):
    """q, k, v as `[1, H, S, D]` strided views of a `[S, 3*H*D]` bf16 buffer on the root."""
    gen = torch.Generator(device=ROOT).manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen, device=ROOT,
                      dtype=torch.bfloat16)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


def plan(counts=(28, 28)):
    return ShardPlan(devices=(ROOT, HELPER), head_counts=counts)


@pytest.mark.parametrize("transport", [TransportMode.PEER, TransportMode.HOST])
@pytest.mark.parametrize("seq_len,counts", [(4099, (28, 28)), (8192, (32, 24))])
def test_split_is_bit_identical_to_one_gpu(transport, seq_len, counts):
    q, k, v = h3_qkv(seq_len)
    with torch.cuda.device(ROOT):
        reference = attention(q, k, v, output="BSF")
        shard = ShardedAttention(plan(counts), transport=transport)
        for seed in (0, 1):  # the second call reuses every buffer
            if seed:
                q, k, v = h3_qkv(seq_len, seed=seed)
                reference = attention(q, k, v, output="BSF")
            out = shard(q, k, v)
            assert shard.last_route == "split"
            assert torch.equal(out, reference)
        assert torch.cuda.current_stream(ROOT) == torch.cuda.default_stream(ROOT)


def test_helper_memory_is_bounded_by_the_ring():
    seq_len = 16_384
    q, k, v = h3_qkv(seq_len)
    with torch.cuda.device(ROOT):
        shard = ShardedAttention(plan(), transport=TransportMode.PEER)
        torch.cuda.synchronize(HELPER)
        torch.cuda.reset_peak_memory_stats(HELPER)
        base = torch.cuda.memory_allocated(HELPER)
        shard(q, k, v)
        torch.cuda.synchronize(ROOT)
        torch.cuda.synchronize(HELPER)
        peak = torch.cuda.max_memory_allocated(HELPER) - base
    bound = sizing.helper_workspace_bytes(seq_len, 28, 128)
    assert peak <= 1.5 * bound, (peak, bound)
    assert peak < 28 * 4 * seq_len * 128 * 2  # far below holding all helper heads at once


def relative_error(out, reference):
    return float((out.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("backend", ["ck_int8", "triton_sage"])
def test_quantizing_backend_split_error_is_bounded(backend):
    rows = {r.name: r for r in list_backends()}
    if not rows[backend].available:
        pytest.skip(rows[backend].reason)
    q, k, v = h3_qkv(8192)
    with torch.cuda.device(ROOT):
        from h3_multigpu.kernels import get_backend
        problems = get_backend(backend).violations(q, k, v)
        if problems:
            pytest.skip("; ".join(problems))
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        reference = reference.transpose(1, 2).reshape(1, 8192, -1)
        bf16_error = relative_error(attention(q, k, v, output="BSF"), reference)
        single = relative_error(attention(q, k, v, backend=backend, output="BSF"), reference)
        split = relative_error(ShardedAttention(plan(), backend=backend)(q, k, v), reference)
    assert split <= 12.0 * bf16_error, (split, bf16_error)
    assert split <= 1.15 * single + 1e-4, (split, single)


def test_helper_failure_falls_back_on_the_root(monkeypatch, caplog):
    sharded_module._warned.clear()
    q, k, v = h3_qkv(4099)

    def failing(self, backend, slot, scale):
        raise torch.OutOfMemoryError("simulated: CUDA out of memory on the helper")

    with torch.cuda.device(ROOT):
        reference = attention(q, k, v, output="BSF")
        shard = ShardedAttention(plan(), chunk_heads=4)
        monkeypatch.setattr(ShardedAttention, "_helper_attention", failing)
        with caplog.at_level(logging.WARNING, logger=sharded_module.__name__):
            outs = [shard(q, k, v) for _ in range(2)]
        assert shard.last_route == "fallback"
        assert all(torch.equal(o, reference) for o in outs)
        assert len([r for r in caplog.records if "helper failed" in r.getMessage()]) == 1
        monkeypatch.undo()
        assert torch.equal(shard(q, k, v), reference) and shard.last_route == "split"


def test_twin_on_two_gpus_is_bit_identical_and_root_is_current():
    config = TwinConfig.tiny(heads=8, head_dim=64, hidden=256, ffn=384)
    model = make_twin(config, dtype=torch.bfloat16, device=ROOT)
    inputs = make_inputs(config, latent_t=4, latent_h=16, latent_w=16, audio_t=20,
                         dtype=torch.bfloat16, device=ROOT)
    with torch.cuda.device(ROOT):  # without Dual-Sage's wrapper the caller makes it current
        plain = TwinPatcher(model).apply_model(*inputs)
    patched = apply_dual_sage(TwinPatcher(model), DualSageConfig(helpers=("cuda:0",),
                                                                 min_tokens=0))
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    shard = override.sharded
    current = []
    original = shard._split

    def spy(*args):
        current.append(torch.cuda.current_device())
        return original(*args)

    shard._split = spy
    with torch.cuda.device(HELPER):  # the wrapper must switch to the root itself
        out = patched.apply_model(*inputs)
    assert current and set(current) == {ROOT.index}
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    status = patched.model_options["transformer_options"]["h3_multigpu"]["dual_sage"]
    assert "cuda:1" in status and "cuda:0" in status and "transport peer" in status
