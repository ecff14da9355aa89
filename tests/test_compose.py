"""All three features on one fp32 model, in any order, on any CPU with any thread count.

What is exact by construction, and asserted with `torch.equal`:
- Dual-Sage (a CPU "helper") and prefetch composed with chunking give the chunked model's output:
  Dual-Sage only regroups attention heads (each head's attention is computed alone either way)
  and prefetch only moves weights, so every GEMM sees the same operands and shapes as with
  chunking alone.
What is not: chunking splits a linear's rows into separate GEMM calls, and MKL/OpenBLAS pick
their kernel and thread split by shape, so a row's fp32 dot products may be summed in another
order (seen: 7e-7 with 2 threads, 0 with 1). That difference is fp32 rounding of the same sums,
so it is held to k times the fp32 forward's own rounding error, measured against an fp64 run of
the same weights: `|chunked - plain| <= K_ROUNDING * |plain_fp32 - fp64|` per output. Both sides
are fp32 evaluations of one function with errors of that size, so their difference is at most
about twice it; K_ROUNDING = 4 leaves room while a broken feature (a wrong row, head or
weight) moves the output by orders of magnitude more (checked by `test_a_broken_feature_fails`).
Each feature's engagement is counted.
"""

import itertools

import pytest
import torch
from twin import TwinPatcher, make_twin

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking
from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

K_ROUNDING = 4.0
CHUNKS = ChunkingConfig(ffn_chunk=13, qkv_chunk=17, head_group=3)
FEATURES = {
    # a helper "device" mapped to the CPU: the shard/gather logic runs, streams are no-ops
    "dual_sage": lambda p: apply_dual_sage(p, DualSageConfig(helpers=("cpu",), split="5:3",
                                                             min_tokens=0)),
    "chunking": lambda p: apply_activation_chunking(p, CHUNKS),
    "prefetch": lambda p: apply_block_prefetch(p, PrefetchConfig(resident_blocks=1, lookahead=1)),
}


class CountingOverride:
    """Counts calls of the installed attention override, passing everything through."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):  # container_function and friends stay visible
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def references(tiny_config_module, tiny_inputs_module):
    """(plain fp32 output, per-output allowed rounding difference) for the seed-0 tiny twin."""
    x, t, c = tiny_inputs_module
    plain = TwinPatcher(make_twin(tiny_config_module, seed=0)).apply_model(x, t, c)
    fp64 = make_twin(tiny_config_module, seed=0, dtype=torch.float64)(x, t, c.double())
    allowed = [K_ROUNDING * (p.double() - r.double()).abs().max().item()
               for p, r in zip(plain, fp64, strict=True)]
    assert all(a > 0 for a in allowed)
    return plain, allowed


@pytest.fixture(scope="module")
def tiny_config_module():
    from twin import TwinConfig

    return TwinConfig.tiny()


@pytest.fixture(scope="module")
def tiny_inputs_module(tiny_config_module):
    from twin import make_inputs

    return make_inputs(tiny_config_module, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)


def compose(model, order):
    patched = TwinPatcher(model, load_device="cpu")
    for name in order:
        patched = FEATURES[name](patched)
    options = patched.model_options["transformer_options"]
    assert set(options["h3_multigpu"]) == set(order), options["h3_multigpu"]
    if "dual_sage" in order:
        options["optimized_attention_override"] = CountingOverride(
            options["optimized_attention_override"])
    return patched


def fc1_rows(model):
    rows = []
    hooks = [b.mlp.fc1.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
             for b in model.blocks]
    return rows, hooks


def assert_rounding_close(out, plain, allowed):
    for o, p, a in zip(out, plain, allowed, strict=True):
        diff = (o.double() - p.double()).abs().max().item()
        assert diff <= a, f"{diff:.3g} > {a:.3g} (k x fp32 rounding)"


@pytest.mark.parametrize("order", list(itertools.permutations(FEATURES)))
def test_features_compose_in_any_order(tiny_config_module, tiny_inputs_module, references,
                                       order):
    plain, allowed = references
    chunked = apply_activation_chunking(
        TwinPatcher(make_twin(tiny_config_module, seed=0)), CHUNKS).apply_model(
            *tiny_inputs_module)
    assert_rounding_close(chunked, plain, allowed)

    # a fresh model per order: the prefetcher moves this model's block weights
    model = make_twin(tiny_config_module, seed=0)
    patched = compose(model, order)
    rows, hooks = fc1_rows(model)
    try:
        for _ in range(2):  # the second step reuses buffers, slots and shards
            out = patched.apply_model(*tiny_inputs_module)
            assert torch.equal(out[0], chunked[0]) and torch.equal(out[1], chunked[1])
    finally:
        for hook in hooks:
            hook.remove()
    # engaged: fc1 saw only <= 13-row chunks, every attention call went through Dual-Sage,
    # and the prefetcher streams all blocks but the resident one
    assert rows and max(rows) <= CHUNKS.ffn_chunk and sum(rows) == 2 * 3 * 44
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert override.calls >= 2 * 4
    assert len(get_block_prefetch(patched).streamed_ids) >= 2


@pytest.mark.parametrize("broken", ["chunk_rows", "head_order", "weight_off_by_0.1%"])
def test_a_broken_feature_fails(tiny_config_module, tiny_inputs_module, references, broken,
                                monkeypatch):
    """The checks above catch a feature that computes something else."""
    plain, allowed = references
    model = make_twin(tiny_config_module, seed=0)
    patched = compose(model, ("dual_sage", "chunking", "prefetch"))
    if broken == "chunk_rows":  # a chunk written one row off
        from h3_multigpu.chunking import wrappers

        original = wrappers.project_rows

        def off_by_one(forward, x, ranges, **kwargs):
            out = original(forward, x, ranges, **kwargs)
            return torch.roll(out, 1, dims=0) if len(ranges) > 1 else out

        monkeypatch.setattr(wrappers, "project_rows", off_by_one)
    elif broken == "head_order":  # shards gathered in the wrong order
        override = patched.model_options["transformer_options"]["optimized_attention_override"]

        def swapped(*args, **kwargs):
            out = override(*args, **kwargs)
            return torch.roll(out, tiny_config_module.head_dim, dims=-1)

        patched.model_options["transformer_options"]["optimized_attention_override"] = swapped
    else:  # a weight-level fault (a block streamed or patched slightly wrong)
        with torch.no_grad():
            model.blocks[2].mlp.fc2.weight.mul_(1.001)
    out = patched.apply_model(*tiny_inputs_module)
    with pytest.raises(AssertionError):
        assert_rounding_close(out, plain, allowed)
