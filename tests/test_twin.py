"""The twin without ComfyUI: shapes, names, determinism, and the forward's documented rules.

Position and timestep spot values are recomputed here from the rules in `tests/twin/layout.py` and
`tests/twin/timesteps.py` with plain Python floats (not the twin's code), so a changed rule fails.
Bit-identity with upstream's class is `tests/test_twin_fidelity.py` (needs ComfyUI).
"""

import math

import pytest
import torch
from twin import (
    SequenceLayout,
    TwinConfig,
    TwinPatcher,
    attention_config_tensor,
    make_conditioning,
    make_inputs,
    make_twin,
    select_checkpoint_attention,
)
from twin import layout as layout_module
from twin.attention import wrap_attn
from twin.timesteps import plan_modulation


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


def test_full_adaln_has_the_time_embedder_and_260m_more_per_block():
    model = make_twin(TwinConfig.full_adaln(), dtype=torch.bfloat16, device="meta")
    adaln = model.blocks[0].adaln_proj.linear
    assert adaln.weight.shape == (6 * 3 * 5376, 2688) and adaln.weight.dtype == torch.bfloat16
    assert 260e6 <= adaln.weight.numel() + adaln.bias.numel() <= 261e6
    assert model.time_embedder.proj_in.weight.shape == (5376, 256)
    assert model.time_embedder.proj_out.weight.dtype == torch.float32
    assert not hasattr(model, "adaln_t_table")
    pruned = make_twin(TwinConfig.full(), dtype=torch.bfloat16, device="meta")
    assert pruned.blocks[0].adaln_proj.linear.weight.dtype == torch.float32


def _expected_keys(cfg: TwinConfig) -> set[str]:
    """Upstream's state-dict names, written out from its module tree."""
    def attention(prefix):
        return {f"{prefix}.attn.{n}.weight" for n in ("qkv_proj", "q_norm", "k_norm", "out_proj")}

    def mlp(prefix):
        return {f"{prefix}.mlp.fc1.weight", f"{prefix}.mlp.fc2.weight"}

    keys = {f"{n}.{p}" for n in ("video_patch_proj", "audio_patch_proj", "condition_proj")
            for p in ("weight", "bias")}
    keys |= {"adaln_t_table", "rope.inv_freq", "token_refiner.final_norm.weight"}
    for j in range(cfg.refiner_blocks):
        p = f"token_refiner.blocks.{j}"
        keys |= attention(p) | mlp(p) | {f"{p}.norm1.weight", f"{p}.norm2.weight"}
    for i in range(cfg.blocks):
        p = f"blocks.{i}"
        keys |= attention(p) | mlp(p) | {f"{p}.norm1.weight", f"{p}.norm2.weight",
                                          f"{p}.adaln_proj.linear.weight",
                                          f"{p}.adaln_proj.linear.bias"}
    keys |= {"final_layer.norm.weight", "final_layer.adaln_proj.linear.weight",
             "final_layer.adaln_proj.linear.bias"}
    keys |= {f"final_layer.{h}.{p}" for h in ("video_out", "audio_out") for p in ("weight", "bias")}
    return keys


def test_state_dict_keys_are_upstreams(tiny_config, tiny_twin):
    assert set(tiny_twin.state_dict()) == _expected_keys(tiny_config)


def test_forward_is_deterministic_and_shaped(tiny_twin, tiny_inputs):
    patcher = TwinPatcher(tiny_twin)
    a = patcher.apply_model(*tiny_inputs)
    b = patcher.apply_model(*tiny_inputs)
    assert a[0].shape == tiny_inputs[0][0].shape and a[1].shape == tiny_inputs[0][1].shape
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(a[0]).all() and torch.isfinite(a[1]).all()


def test_odd_latent_sizes_are_padded_and_cropped(tiny_config, tiny_twin):
    x, t, c = make_inputs(tiny_config, latent_t=2, latent_h=5, latent_w=3, audio_t=4)
    out = TwinPatcher(tiny_twin).apply_model(x, t, c)
    assert out[0].shape == x[0].shape and torch.isfinite(out[0]).all()


# ----------------------------------------------------------------------------- positions
def _axis(cells: int, side: float) -> list[float]:
    ratio, count = cells / side, cells // 2
    return [((1.0 - ratio) / 2.0 + j * ratio / count) * 32.0 for j in range(count)]


def test_positions_follow_the_documented_rules():
    text, frames, lat_h, lat_w, audio_t = 16, 7, 4, 6, 5
    layout = SequenceLayout(text, frames, lat_h, lat_w, audio_t)
    pos = layout.position_ids
    assert [k for _, _, k in layout.segments] == ["text", "audio", "video"]
    assert pos.dtype == torch.float64 and pos.shape == (16 + 10 + 7 * 6, 3)
    assert pos[5].tolist() == [5.0, 0.0, 0.0]
    side = math.sqrt(lat_h * lat_w)
    hs, ws = _axis(lat_h, side), _axis(lat_w, side)
    # audio: t = origin + r on both channels, h = 0, w pinned to the grid's first / last w
    a0 = layout.span("audio")[0]
    assert pos[a0 + 3].tolist() == pytest.approx([16 + 3, 0.0, ws[0]], rel=1e-12)
    assert pos[a0 + 5 + 3].tolist() == pytest.approx([16 + 3, 0.0, ws[-1]], rel=1e-12)
    # video: per-frame spans 5/3 * (1, 4, 4, 4, 4, 1, 4, ...), area-normalised h and w
    starts = [16.0]
    for k in range(frames - 1):
        starts.append(starts[-1] + 5.0 / 3.0 * (1 if k % 5 == 0 else 4))
    v0 = layout.span("video")[0]
    for frame in (0, 1, 5, 6):
        for j, (hi, wi) in enumerate([(0, 0), (1, 2)]):
            row = v0 + frame * 6 + hi * 3 + wi
            expected = [starts[frame], hs[hi], ws[wi]]
            assert pos[row].tolist() == pytest.approx(expected, rel=1e-12), (frame, j)


def test_keyframe_and_reference_rows_take_their_places():
    kf = [{"resolved_frame_index": 8, "latent": torch.zeros(1, 24, 1, 4, 6),
           "audio_latent": torch.zeros(1, 32, 2, 3)}]
    layout = SequenceLayout(4, 2, 4, 6, 5, keyframes=kf)
    assert [k for _, _, k in layout.segments] == ["text", "cond", "cond_audio", "audio", "video"]
    a, _ = layout.span("cond")
    assert layout.position_ids[a, 0].item() == pytest.approx(4 + 5.0 / 3.0 * 8, rel=1e-12)
    assert layout.img_update.tolist() == [False] * 6 + [True] * 12
    assert layout.audio_update.tolist() == [False] * 6 + [True] * 10

    refs = [{"kind": "image", "latent_h": 2, "latent_w": 4},
            {"kind": "video_audio", "latent_h": 4, "latent_w": 2, "latent_t": 2,
             "ref_audio_t": 4}]
    layout = SequenceLayout(4, 2, 4, 6, 5, refs=refs)
    assert [k for _, _, k in layout.segments] == ["text", "ref_img", "ref_audio", "ref_img",
                                                  "audio", "video"]
    # targets start after text + image (1) + max(audio 4, frame spans 5/3 + 20/3)
    origin = 4 + 1 + max(4.0, 5.0 / 3.0 + 20.0 / 3.0)
    assert layout.position_ids[layout.span("audio")[0], 0].item() == pytest.approx(origin)
    assert layout.position_ids[layout.span("ref_audio")[0], 0].item() == 5.0


# ----------------------------------------------------------------------------- timesteps
def _shifted(sigma: float, a: float, b: float) -> float:
    base = sigma / (a + sigma * (1 - a))
    return b * base / (1 + (b - 1) * base)


def test_audio_runs_on_its_own_schedule_and_cond_rows_near_clean():
    kf = [{"resolved_frame_index": 0, "latent": torch.zeros(1, 24, 1, 4, 6)}]
    layout = SequenceLayout(4, 2, 4, 6, 5, keyframes=kf)
    plan = plan_modulation(layout, 0.7, (12.0, 3.0), {}, None, None)
    t_a = 1 - _shifted(0.7, 12.0, 3.0)
    assert plan.timesteps == pytest.approx(sorted([0.3, t_a, 0.999]), rel=1e-12)
    rows = {kind: row for (a, b, row), (_, _, kind) in zip(plan.mod_segments,
                                                                   layout.segments, strict=True)}
    t_index = {round(t, 9): i for i, t in enumerate(plan.timesteps)}
    assert rows["text"] == 3 * t_index[0.3] + 1 and rows["video"] == 3 * t_index[0.3]
    assert rows["audio"] == 3 * t_index[round(t_a, 9)] + 2
    assert rows["cond"] == 3 * t_index[0.999]


def test_sigma_math_follows_the_release(tiny_config):
    """0.33.0 shifts the fp32 sigma tensor (t_a rounded in fp32), the newest files a float."""
    layout = SequenceLayout(4, 2, 4, 6, 5)
    sigma = torch.tensor(0.7, dtype=torch.float32)
    t_float = plan_modulation(layout, float(sigma), (12.0, 3.0), {}, None, None).timesteps
    t_fp32 = plan_modulation(layout, sigma, (12.0, 3.0), {}, None, None).timesteps
    s32 = sigma.item()
    assert max(t_float) == 1 - _shifted(s32, 12.0, 3.0)  # float64 arithmetic
    base = sigma / (12.0 + sigma * (1 - 12.0))
    assert max(t_fp32) == float(1 - 3.0 * base / (1 + 2.0 * base))  # fp32 arithmetic
    assert torch.tensor(t_float).ne(torch.tensor(t_fp32)).any()  # one fp32 ulp apart here
    x, t, c = make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)
    outs = [make_twin(TwinConfig.tiny(sigma_math=m, adaln_grid=None), seed=0)(x, t, c)
            for m in ("float", "fp32")]
    assert not torch.equal(outs[0][1], outs[1][1])  # the forward follows it
    with pytest.raises(ValueError, match="sigma_math"):
        TwinConfig.tiny(sigma_math="bf16")


def test_audio_mask_gives_rows_their_own_timesteps(tiny_config, tiny_twin, tiny_inputs):
    x, t, c = tiny_inputs
    mask = torch.ones(1, 1, 2, 5)
    mask[..., 1:3] = 0.25
    layout = SequenceLayout(16, 3, 4, 6, 5)
    plan = plan_modulation(layout, 0.7, (12.0, 3.0), {}, None, mask)
    a, b, rows = plan.mod_segments[1]
    sigma_a = _shifted(0.7, 12.0, 3.0)
    per_row = [min(1 - m * sigma_a, 1.0) for m in mask.reshape(-1).tolist()]
    assert [plan.timesteps[r // 3] for r in rows.tolist()] == pytest.approx(per_row, rel=1e-6)
    assert all(r % 3 == 2 for r in rows.tolist())
    plain = tiny_twin(x, t, c)
    masked = tiny_twin(x, t, c, audio_denoise_mask=mask)
    assert not torch.equal(plain[1][..., 0], masked[1][..., 0])  # relabelled neighbours
    kept = mask.clone()
    kept[..., 4] = 0.0  # a preserved row: zero velocity
    out = tiny_twin(x, t, c, audio_denoise_mask=kept)
    assert torch.equal(out[1][..., 4], torch.zeros_like(out[1][..., 4]))


def test_video_mask_scales_velocity_and_relabels_rows(tiny_twin, tiny_inputs):
    x, t, c = tiny_inputs
    ones = torch.ones(1, 1, 3, 4, 6)
    plain, same = tiny_twin(x, t, c), tiny_twin(x, t, c, denoise_mask=ones)
    assert torch.equal(plain[0], same[0])
    half = ones.clone()
    half[:, :, 0] = 0.0  # first latent frame preserved
    out = tiny_twin(x, t, c, denoise_mask=half)
    assert torch.equal(out[0][:, :, 0], torch.zeros_like(out[0][:, :, 0]))
    assert not torch.equal(out[0][:, :, 1:], plain[0][:, :, 1:])  # other rows see new labels


def test_audio_scale_carry(tiny_twin, tiny_inputs):
    x, t, c = tiny_inputs
    seen = {}

    def record(executor, x, *args, **kwargs):
        seen["audio_in"] = x[1]
        out = executor(x, *args, **kwargs)
        seen["audio_out"] = out[1].clone()
        return out

    options = {"wrappers": {"diffusion_model": {"probe": [record]}}}
    scale = 4.0
    out = tiny_twin(x, t, c, transformer_options=options,
                    minimax_payload={"audio_scale": scale})
    sigma_v = (t[0] / 1000.0).float()
    sigma_a = _shifted(sigma_v, 12.0, 3.0)
    factor = sigma_a / sigma_v
    assert torch.equal(seen["audio_in"], x[1] * factor)
    expected = (1 - scale) * (x[1] * factor) + (1 + (scale - 1) * sigma_a) * seen["audio_out"]
    assert torch.equal(out[1], expected)


# ----------------------------------------------------------------------------- conditioning
def test_refiner_runs_in_the_forward_only_for_encoder_width_context(tiny_twin, tiny_inputs):
    x, t, c = tiny_inputs
    calls = []
    handle = tiny_twin.token_refiner.register_forward_hook(lambda *a: calls.append(1))
    try:
        raw = tiny_twin(x, t, c)
        assert len(calls) == 1
        cond = make_conditioning(tiny_twin, c, x)
        assert len(calls) == 2 and cond["context"].shape[-1] == tiny_twin.hidden_size
        refined = tiny_twin(x, t, cond["context"], minimax_payload=cond["minimax_payload"])
        assert len(calls) == 2  # the forward skipped it
    finally:
        handle.remove()
    assert torch.equal(raw[0], refined[0]) and torch.equal(raw[1], refined[1])


def test_conditioning_prebuilds_the_layout_once(tiny_twin, tiny_inputs, monkeypatch):
    x, t, c = tiny_inputs
    cond = make_conditioning(tiny_twin, c, x)
    built = []
    original = layout_module.SequenceLayout.__init__
    monkeypatch.setattr(layout_module.SequenceLayout, "__init__",
                        lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    options: dict = {}
    for _ in range(2):
        tiny_twin(x, t, cond["context"], transformer_options=options, **{
            "minimax_payload": cond["minimax_payload"]})
    assert built == [] and options["minimax_h3_layout"] is cond["minimax_payload"]["layout"]


def test_keyframes_references_and_tags_change_the_output(tiny_twin, tiny_inputs):
    x, t, c = tiny_inputs
    plain = tiny_twin(x, t, c)
    g = torch.Generator().manual_seed(2)
    kf = [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)}]
    refs = [{"kind": "audio", "ref_audio_t": 3, "audio_latent": torch.randn(1, 32, 2, 3,
                                                                           generator=g)}]
    tags = torch.tensor([1] * 6 + [0] * 4 + [1] * 6)
    for kwargs in ({"keyframes": kf}, {"refs": refs}, {"text_token_tags": tags}):
        cond = make_conditioning(tiny_twin, c, x, **kwargs)
        out = tiny_twin(x, t, cond["context"], minimax_payload=cond["minimax_payload"])
        assert out[0].shape == plain[0].shape and not torch.equal(out[0], plain[0]), kwargs
    segments = cond["minimax_payload"]["layout"].segments
    assert segments[0] == (0, 16, "text")


# ----------------------------------------------------------------------------- hooks
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


def test_checkpoint_attention_config_selects_the_preferred_function(tiny_config, tiny_inputs):
    model = make_twin(tiny_config, seed=0)
    state = model.state_dict()
    state["blocks.1.attn.comfy_attention.config"] = attention_config_tensor("comfy_kitchen_int8")
    model.load_state_dict(state)
    slot = model.blocks[1].attn.comfy_attention
    assert slot.config == {"attention": "comfy_kitchen_int8"}
    assert "blocks.1.attn.comfy_attention.config" in model.state_dict()
    calls = []

    def preferred(q, k, v, heads, **kwargs):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(
            1, -1, heads * q.shape[-1])

    slot.function = wrap_attn(preferred)  # as ComfyUI's own: takes the containers
    TwinPatcher(model).apply_model(*tiny_inputs)
    assert len(calls) == 1
    state["blocks.1.attn.comfy_attention.config"] = attention_config_tensor("no_such_kernel")
    model.load_state_dict(state)
    assert slot.config is None and slot.function is None
    # the same without a state dict; no INT8 kernel on a CPU, so no function either
    assert select_checkpoint_attention(model, "comfy_kitchen_int8", torch.device("cpu")) == 0
    assert slot.config == {"attention": "comfy_kitchen_int8"}
    with pytest.raises(ValueError, match="no_such_kernel"):
        select_checkpoint_attention(model, "no_such_kernel")


def test_block_replace_patch_gets_layout_and_can_swap_attention(tiny_twin, tiny_inputs):
    calls, attention_calls = [], []

    def patch(args, extra):
        calls.append(sorted(args))
        assert args["layout"] is args["transformer_options"]["minimax_h3_layout"]
        block = tiny_twin.blocks[1]

        def attention(h, **kwargs):
            attention_calls.append(h.shape)
            return block.attn(h, **kwargs)

        return extra["original_block"]({**args, "attention": attention})

    patcher = TwinPatcher(tiny_twin).clone()
    patcher.set_model_patch_replace(patch, "dit", "double_block", 1)
    out = patcher.apply_model(*tiny_inputs)
    ref = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert calls == [["img", "layout", "mod_segments", "rope_freqs", "t_emb",
                      "transformer_options"]]
    assert attention_calls == [(44, tiny_twin.hidden_size)]


def test_wrappers_see_the_model_as_class_obj(tiny_twin, tiny_inputs):
    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append(executor.class_obj)
        return executor(*args, **kwargs)

    patcher = TwinPatcher(tiny_twin).clone()
    patcher.add_wrapper_with_key("diffusion_model", "probe", wrapper)
    patcher.apply_model(*tiny_inputs)
    assert seen == [tiny_twin]


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


def test_comfyui_attention_rebinds_the_dispatch_and_restores_it(tiny_twin, tiny_inputs):
    from types import SimpleNamespace

    from twin import AttentionTensorContainer, comfyui_attention
    from twin import model as layers
    from twin.attention import optimized_attention

    calls = []

    def dispatch(q, k, v, heads, **kwargs):
        calls.append(heads)
        return optimized_attention(q, k, v, heads, **kwargs)

    fake = SimpleNamespace(optimized_attention=dispatch,
                           AttentionTensorContainer=AttentionTensorContainer)
    plain = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    with comfyui_attention(fake):
        routed = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    assert calls == [8] * 4 and torch.equal(plain[0], routed[0])
    assert layers.optimized_attention is optimized_attention


def test_mask_conditioning_pools_to_patches_and_channels():
    from twin import mask_conditioning

    video = torch.ones(1, 24, 2, 4, 6)
    video[:, :, 0, :2, :2] = 0.0  # one whole 2x2 patch preserved
    video[:, :, 1, 0, 0] = 0.0  # one pixel of a patch: the patch's max is still 1
    audio = torch.ones(1, 32, 2, 5)
    audio[:, :, 0, 1] = 0.3
    audio[:, 5, 0, 1] = 0.6  # max over channels wins, rounded up to 1/256
    out = mask_conditioning(video, audio)
    assert out["denoise_mask"].shape == (1, 1, 2, 4, 6)
    assert out["denoise_mask"][0, 0, 0, :2, :2].eq(0).all()
    assert out["denoise_mask"].sum().item() == 2 * 24 - 4
    assert out["audio_denoise_mask"].shape == (1, 1, 2, 5)
    assert out["audio_denoise_mask"][0, 0, 0, 1].item() == math.ceil(0.6 * 256) / 256
    assert mask_conditioning(torch.ones_like(video), torch.ones_like(audio)) == {}
