"""All three features on one model, in any order: the output equals the plain twin's exactly."""

import itertools

import pytest
import torch

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking
from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch
from h3_multigpu.twin import TwinPatcher

FEATURES = {
    # a helper "device" mapped to the CPU: the shard/gather logic runs, streams are no-ops
    "dual_sage": lambda p: apply_dual_sage(p, DualSageConfig(helpers=("cpu",), split="5:3",
                                                             min_tokens=0)),
    "chunking": lambda p: apply_activation_chunking(
        p, ChunkingConfig(ffn_chunk=13, qkv_chunk=17, head_group=3)),
    "prefetch": lambda p: apply_block_prefetch(p, PrefetchConfig(resident_blocks=1, lookahead=1)),
}


@pytest.mark.parametrize("order", list(itertools.permutations(FEATURES)))
def test_features_compose_in_any_order(tiny_config, order):
    from h3_multigpu.twin import make_inputs, make_twin

    # bf16, the production dtype: on CPU, multithreaded fp32 GEMMs switch kernels with the row
    # count, so a row-chunked fp32 linear can differ in the last bit; bf16 GEMMs do not
    tiny_inputs = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5,
                              seed=1, dtype=torch.bfloat16)
    # a fresh model per order: the prefetcher moves this model's block weights
    model = make_twin(tiny_config, dtype=torch.bfloat16, seed=0)
    plain = TwinPatcher(model).apply_model(*tiny_inputs)
    patched = TwinPatcher(model, load_device="cpu")
    for name in order:
        patched = FEATURES[name](patched)
    status = patched.model_options["transformer_options"]["h3_multigpu"]
    assert set(status) == set(FEATURES), status
    for _ in range(2):  # the second step reuses buffers, slots and shards
        out = patched.apply_model(*tiny_inputs)
        assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
