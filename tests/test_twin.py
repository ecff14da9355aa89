import pytest
import torch

from h3_multigpu.twin import TwinConfig, TwinPatcher, make_inputs, make_twin


def test_full_config_has_upstream_parameter_count_per_block():
    model = make_twin(TwinConfig.full(), dtype=torch.bfloat16, device="meta")
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    linears = sum(m.weight.numel() for m in (model.blocks[0].attn.qkv_proj,
                                             model.blocks[0].attn.out_proj,
                                             model.blocks[0].mlp.fc1, model.blocks[0].mlp.fc2))
    assert linears == 385_351_680
    assert 385e6 <= per_block <= 387e6
    assert len(model.blocks) == 50 and len(model.token_refiner.blocks) == 2
    assert model.blocks[7].attn.qkv_proj.weight.shape == (21504, 5376)
    assert model.blocks[7].mlp.fc1.weight.shape == (28672, 5376)


def test_module_paths_match_upstream(tiny_twin):
    names = {n for n, _ in tiny_twin.named_parameters()}
    for expected in ("blocks.0.attn.qkv_proj.weight", "blocks.0.attn.q_norm.weight",
                     "blocks.0.attn.k_norm.weight", "blocks.0.attn.out_proj.weight",
                     "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight",
                     "blocks.0.adaln_proj.linear.weight",
                     "token_refiner.blocks.0.attn.qkv_proj.weight"):
        assert expected in names


def test_forward_is_deterministic_and_shaped(tiny_twin, tiny_inputs):
    patcher = TwinPatcher(tiny_twin)
    a = patcher.apply_model(*tiny_inputs)
    b = patcher.apply_model(*tiny_inputs)
    assert a[0].shape == tiny_inputs[0][0].shape and a[1].shape == tiny_inputs[0][1].shape
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(a[0]).all()


def test_override_sees_upstream_calling_convention(tiny_twin, tiny_inputs):
    seen = []

    def override(func, q, k, v, heads, **kwargs):
        seen.append((q.shape, q.is_contiguous(), heads, kwargs["skip_reshape"], kwargs["mask"]))
        return func(q, k, v, heads, **kwargs)

    patcher = TwinPatcher(tiny_twin).clone()
    patcher.set_model_optimized_attention(override)
    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    patched = patcher.apply_model(*tiny_inputs)
    assert torch.equal(plain[0], patched[0])
    # refiner (text only, S=16) then 3 blocks over S = 16 + 10 + 18 = 44, strided views
    assert [s[0][2] for s in seen] == [16, 44, 44, 44]
    assert all(not s[1] and s[2] == 8 and s[3] is True and s[4] is None for s in seen)


def test_block_replace_patch_gets_original_block(tiny_twin, tiny_inputs):
    calls = []

    def patch(args, extra):
        calls.append(sorted(args))
        return extra["original_block"](args)

    patcher = TwinPatcher(tiny_twin).clone()
    patcher.set_model_patch_replace(patch, "dit", "double_block", 1)
    out = patcher.apply_model(*tiny_inputs)
    ref = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    assert torch.equal(out[0], ref[0])
    assert calls == [["img", "mod_segments", "rope_freqs", "t_emb", "transformer_options"]]


def test_clone_does_not_leak_patches(tiny_twin):
    base = TwinPatcher(tiny_twin)
    clone = base.clone()
    clone.set_model_optimized_attention(lambda *a, **k: None)
    assert "optimized_attention_override" not in base.model_options["transformer_options"]


def test_batch_size_must_be_one(tiny_config, tiny_twin):
    x, t, c = make_inputs(tiny_config, latent_t=2, latent_h=2, latent_w=2, audio_t=2)
    x = [torch.cat([x[0], x[0]]), x[1]]
    with pytest.raises(ValueError, match="batch size 1"):
        TwinPatcher(tiny_twin).apply_model(x, t, c)
