import sys
import types

import pytest
import torch
import torch.nn.functional as F

from h3_multigpu.kernels import (
    AttentionCall,
    attention,
    get_backend,
    list_backends,
    mark_unavailable,
    use_backend,
)
from h3_multigpu.kernels import backends as backends_module
from h3_multigpu.kernels.backends import SAGEATTENTION_RULES


def strided_qkv(seq_len=37, heads=8, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v as `[1, H, S, D]` views of one `[S, 3*H*D]` buffer, like H3's qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen).to(device, dtype)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


def test_every_backend_is_listed_with_a_reason():
    rows = {r.name: r for r in list_backends()}
    assert {"sdpa", "ck_int8", "sageattention", "flash", "triton_sage"} <= set(rows)
    assert rows["sdpa"].available
    assert all(r.reason for r in rows.values())


def test_sdpa_matches_pytorch_and_both_layouts():
    q, k, v = strided_qkv()
    out_BHSD = attention(q, k, v)
    assert torch.equal(out_BHSD, F.scaled_dot_product_attention(q, k, v))
    out_BSF = attention(q, k, v, output="BSF")
    assert out_BSF.shape == (1, 37, 8 * 16)
    assert torch.equal(out_BSF, out_BHSD.transpose(1, 2).reshape(1, 37, 128))


def test_unknown_and_unavailable_backends_raise_with_the_reason():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
    mark_unavailable("test_gone", "because the test says so")
    with pytest.raises(ValueError, match="because the test says so"):
        get_backend("test_gone")


def test_use_backend_sets_the_default_inside_the_block():
    assert get_backend().name == "sdpa"
    with use_backend("sdpa") as backend:
        assert get_backend() is backend
    assert get_backend().name == "sdpa"


def test_ck_int8_refuses_cpu_tensors():
    rows = {r.name: r for r in list_backends()}
    if not rows["ck_int8"].available:
        pytest.skip(rows["ck_int8"].reason)
    q, k, v = strided_qkv(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device cpu"):
        attention(q, k, v, backend="ck_int8")


def sage_call(seq_len, row_stride, head_dim=128):
    return AttentionCall(batch=1, heads=56, seq_q=seq_len, seq_k=seq_len, head_dim=head_dim,
                         dtype=torch.bfloat16, device=torch.device("cuda", 0),
                         max_row_stride=row_stride)


def broken(call):
    return [r.description for r in SAGEATTENTION_RULES if not r.check(call)]


def test_sageattention_rules_refuse_padding_and_32bit_overflow():
    assert broken(sage_call(4096, 21504)) == []
    assert broken(sage_call(68_672, 21504)) == []  # 68,672 x 21,504 < 2^31, multiple of 64
    padded = broken(sage_call(68_706, 21504))
    assert len(padded) == 1 and "multiple of 64" in padded[0]
    overflow = broken(sage_call(102_080, 21504))  # a multiple of 64, but past 2^31 elements
    assert len(overflow) == 1 and "2^31" in overflow[0]
    assert broken(sage_call(102_080, 128)) == []  # a contiguous copy would fit
    assert "head dim" in broken(sage_call(4096, 128, head_dim=80))[0]


def test_sageattention_gets_a_private_copy_of_k():
    seen = {}

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None):
        seen["layout"] = tensor_layout
        k.sub_(k.mean(dim=2, keepdim=True))  # what the PyPI kernel does to its k argument
        return F.scaled_dot_product_attention(q, k, v, scale=sm_scale)

    real = sys.modules.get("sageattention")
    sys.modules["sageattention"] = types.SimpleNamespace(sageattn=sageattn)
    backends_module._register_sageattention()
    try:
        q, k, v = strided_qkv()
        k_before = k.clone()
        out = get_backend("sageattention").fn(q, k, v)
        assert torch.equal(k, k_before)
        assert seen["layout"] == "HND"
        # softmax is invariant to a per-query constant: subtracting K's mean changes nothing
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    finally:  # put back whatever this process really has (the GPU tests below use it)
        if real is None:
            del sys.modules["sageattention"]
        else:
            sys.modules["sageattention"] = real
        backends_module._register_sageattention()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ck_int8", "sageattention", "flash", "triton_sage"])
def test_fast_backend_error_is_bounded_against_fp32(name):
    rows = {r.name: r for r in list_backends()}
    if not rows[name].available:
        pytest.skip(rows[name].reason)
    q, k, v = strided_qkv(seq_len=4096, heads=8, head_dim=128, dtype=torch.bfloat16,
                          device="cuda")
    backend = get_backend(name)
    if backend.violations(q, k, v):
        pytest.skip("; ".join(backend.violations(q, k, v)))
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    bf16_error = (attention(q, k, v).float() - reference).norm() / reference.norm()
    k_before = k.clone()
    error = (attention(q, k, v, backend=name).float() - reference).norm() / reference.norm()
    assert torch.equal(k, k_before)
    bound = 12.0 if backend.quantizing else 2.0  # INT8 kernels: ~1.7% vs bf16's ~0.2%
    assert error <= bound * bf16_error, (name, float(error), float(bf16_error))


@pytest.mark.gpu
def test_sageattention_refuses_unpadded_sequence_on_gpu():
    rows = {r.name: r for r in list_backends()}
    if not rows["sageattention"].available:
        pytest.skip(rows["sageattention"].reason)
    q, k, v = strided_qkv(seq_len=4099, heads=8, head_dim=128, dtype=torch.bfloat16,
                          device="cuda")
    with pytest.raises(ValueError, match="multiple of 64"):
        attention(q, k, v, backend="sageattention")
