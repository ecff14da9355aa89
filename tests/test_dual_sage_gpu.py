"""Dual-Sage on two real GPUs: root cuda:1 (as in production), helper cuda:0."""

import logging

import pytest
import torch
import torch.nn.functional as F
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.exactness import ExactRange
from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    ShardPlan,
    TransportMode,
    apply_dual_sage,
    sizing,
)
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.dual_sage.apply import per_heads
from h3_multigpu.kernels import list_backends
from h3_multigpu.kernels.comfy_calling import backend_function

pytestmark = pytest.mark.multi_gpu
ROOT, HELPER = torch.device("cuda", 1), torch.device("cuda", 0)


def h3_qkv(seq_len, heads=56, head_dim=128, seed=0):
    """q, k, v as `[1, H, S, D]` strided views of a `[S, 3*H*D]` bf16 buffer on the root."""
    gen = torch.Generator(device=ROOT).manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen, device=ROOT,
                      dtype=torch.bfloat16)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


def sdpa(q, k, v):
    """PyTorch SDPA with its default kernel choice (attend's contract: [1, h, S, D])."""
    return F.scaled_dot_product_attention(q, k, v)


def whole(q, k, v):
    b, h, s, d = q.shape
    return sdpa(q, k, v).transpose(1, 2).reshape(b, s, h * d)


def plan(counts=(28, 28)):
    return ShardPlan(devices=(ROOT, HELPER), head_counts=counts)


@pytest.mark.parametrize("transport", [TransportMode.PEER, TransportMode.HOST])
@pytest.mark.parametrize("seq_len,counts", [(3_320, (28, 28)), (4099, (28, 28)),
                                            (8192, (32, 24))])
def test_split_in_the_exact_range_is_bit_identical_to_one_gpu(transport, seq_len, counts):
    """The shipped exact range at work: at 3,320 tokens 4-head chunks are inexact with flash,
    so the chunks grow; the split stays bit-identical at every length."""
    with torch.cuda.device(ROOT):
        shard = ShardedAttention(plan(counts), transport=transport,
                                 exact_range=ExactRange.load())
        for seed in (0, 1):  # the second call reuses every buffer
            q, k, v = h3_qkv(seq_len, seed=seed)
            out = shard(q, k, v, sdpa)
            assert shard.last_route == "split"
            assert torch.equal(out, whole(q, k, v))
        assert torch.cuda.current_stream(ROOT) == torch.cuda.default_stream(ROOT)


def test_comfyuis_sdpa_priority_split_is_bit_identical():
    """The function ComfyUI runs on CUDA (SDPA under its backend priority), sharded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def comfy_like(q, k, v):
        with sdpa_kernel(order, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v)

    with torch.cuda.device(ROOT):
        shard = ShardedAttention(plan(), exact_range=ExactRange.load())
        for seq_len in (3_320, 16_008):
            q, k, v = h3_qkv(seq_len)
            reference = comfy_like(q, k, v).transpose(1, 2).reshape(1, seq_len, -1)
            assert torch.equal(shard(q, k, v, comfy_like), reference)
        assert shard.routes["split"] == 2


def test_helper_memory_is_bounded_by_the_ring():
    seq_len = 16_384
    q, k, v = h3_qkv(seq_len)
    with torch.cuda.device(ROOT):
        shard = ShardedAttention(plan(), transport=TransportMode.PEER)
        torch.cuda.synchronize(HELPER)
        torch.cuda.reset_peak_memory_stats(HELPER)
        base = torch.cuda.memory_allocated(HELPER)
        shard(q, k, v, sdpa)
        torch.cuda.synchronize(ROOT)
        torch.cuda.synchronize(HELPER)
        peak = torch.cuda.max_memory_allocated(HELPER) - base
        shard.release()
        torch.cuda.synchronize(ROOT)
        torch.cuda.synchronize(HELPER)
        assert torch.cuda.memory_allocated(HELPER) == base  # release hands everything back
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
        bf16_error = relative_error(whole(q, k, v), reference)
        function = backend_function(backend)
        single = relative_error(function(q, k, v, 56, skip_reshape=True), reference)
        attend = per_heads(function, {"skip_reshape": True})
        split = relative_error(ShardedAttention(plan())(q, k, v, attend), reference)
    assert split <= 12.0 * bf16_error, (split, bf16_error)
    assert split <= 1.15 * single + 1e-4, (split, single)


def test_helper_failure_falls_back_on_the_root(monkeypatch, caplog):
    sharded_module._warned.clear()
    q, k, v = h3_qkv(4099)

    def failing(self, attend, slot):
        raise torch.OutOfMemoryError("simulated: CUDA out of memory on the helper")

    with torch.cuda.device(ROOT):
        reference = whole(q, k, v)
        shard = ShardedAttention(plan(), chunk_heads=4)
        monkeypatch.setattr(ShardedAttention, "_helper_attention", failing)
        with caplog.at_level(logging.WARNING, logger=sharded_module.__name__):
            outs = [shard(q, k, v, sdpa) for _ in range(2)]
        assert shard.last_route == "fallback" and shard.workspace_allocations == 1
        assert all(torch.equal(o, reference) for o in outs)
        assert len([r for r in caplog.records if "helper failed" in r.getMessage()]) == 1
        monkeypatch.undo()
        shard.release()  # ComfyUI's cleanup after the run: the next run retries
        assert torch.equal(shard(q, k, v, sdpa), reference) and shard.last_route == "split"


def test_twin_on_two_gpus_is_bit_identical_and_root_is_current():
    config = TwinConfig.tiny(heads=8, head_dim=64, hidden=256, ffn=384)
    model = make_twin(config, dtype=torch.bfloat16, device=ROOT)
    # 4 x 40 x 40 video tokens + audio + text: ~6.4k rows, so each GPU's 4 heads per call are
    # inside the measured exact range (flash: >= 116.7 heads x rows per SM) and the calls split
    inputs = make_inputs(config, latent_t=4, latent_h=80, latent_w=80, audio_t=20,
                         dtype=torch.bfloat16, device=ROOT)
    with torch.cuda.device(ROOT):  # without Dual-Sage's wrapper the caller makes it current
        plain = TwinPatcher(model).apply_model(*inputs)
    patched = apply_dual_sage(TwinPatcher(model), DualSageConfig(helpers=("cuda:0",),
                                                                 min_tokens=0))
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    shard = override.sharded
    current = []
    original = shard._split

    lengths = []

    def spy(*args):
        current.append(torch.cuda.current_device())
        lengths.append(args[1].shape[2])  # _split(attend, q_BHSD, ...)
        return original(*args)

    shard._split = spy
    with torch.cuda.device(HELPER):  # the wrapper must switch to the root itself
        out = patched.apply_model(*inputs)
    assert current and set(current) == {ROOT.index}, (current, dict(shard.routes))
    exact = ExactRange.load()
    assert all(exact.min_heads(ROOT, s, torch.bfloat16, 64) <= 4 for s in lengths), lengths
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    status = protocol.status_lines(patched)["dual_sage"]
    assert "cuda:1" in status and "cuda:0" in status and "transport peer" in status
