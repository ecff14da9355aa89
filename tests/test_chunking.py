"""Chunked FFN/QKV and head-group attention on the tiny twin: bit-identical, hooks preserved.

The twin runs in bf16, the production dtype. (On CPU, fp32 GEMMs switch MKL kernels with the
row count, so a row-chunked fp32 linear can differ in the last bit; bf16 GEMMs do not.)
"""

from __future__ import annotations

import pytest
import torch
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin
from twin.adapters import attach_activation_lora

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking, sizing
from h3_multigpu.chunking.wrappers import project_rows
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common import floors as common_floors
from h3_multigpu.common.formats import activation_adapters

BF16 = torch.bfloat16


@pytest.fixture
def bf16_twin(tiny_config):
    return make_twin(tiny_config, dtype=BF16, seed=3)


@pytest.fixture
def bf16_inputs(tiny_config):
    # S = 16 text + 10 audio + 18 video = 44 rows; segment borders at 16 and 26
    return make_inputs(tiny_config, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=5,
                       dtype=BF16)


def _with_lora(model, rank: int = 4):
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(attach_activation_lora(block.attn.qkv_proj, rank, seed=100 + i))
        hooks.append(attach_activation_lora(block.mlp.fc1, rank, seed=200 + i))
    return hooks


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


CONFIGS = [
    ChunkingConfig(ffn_chunk=7),  # 44 = 6*7 + 2 rows: chunks do not divide S
    ChunkingConfig(qkv_chunk=5),
    ChunkingConfig(head_group=3),  # 8 heads = 3 + 3 + 2
    ChunkingConfig(ffn_chunk=9, qkv_chunk=13, head_group=5),
    ChunkingConfig(ffn_chunk=3, qkv_chunk=2, head_group=1),
    ChunkingConfig(ffn_chunk=100, qkv_chunk=100, head_group=8),  # one chunk, all heads
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.ffn_chunk}-{c.qkv_chunk}-"
                                                       f"{c.head_group}")
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_chunked_model_is_bit_identical(bf16_twin, bf16_inputs, config, lora):
    if lora:
        _with_lora(bf16_twin)
    base = TwinPatcher(bf16_twin)
    reference = base.apply_model(*bf16_inputs)
    patched = apply_activation_chunking(base, config)
    out = patched.apply_model(*bf16_inputs)
    assert _equal(out, reference)
    chunkers = get_chunking(patched).chunkers
    runs = [chunkers[i].last_chunks for i in range(len(bf16_twin.blocks))]
    assert runs == [(config.ffn_chunk, config.qkv_chunk, config.head_group)] * 3
    # engaged: each wrapped module ran once per row chunk of its phase
    rows = sizing.row_chunks
    for chunker in chunkers.values():
        assert chunker.calls == {"attn.qkv_proj": len(rows(44, config.qkv_chunk)),
                                 "attn.out_proj": len(rows(44, config.qkv_chunk)),
                                 "mlp": len(rows(44, config.ffn_chunk))}


def test_lora_changes_the_output(bf16_twin, bf16_inputs):
    plain = TwinPatcher(bf16_twin).apply_model(*bf16_inputs)
    hooks = _with_lora(bf16_twin)
    adapted = TwinPatcher(bf16_twin).apply_model(*bf16_inputs)
    assert not torch.equal(plain[0], adapted[0])
    for hook in hooks:
        hook.eject()
    assert _equal(TwinPatcher(bf16_twin).apply_model(*bf16_inputs), plain)


def test_big_linears_only_ever_see_chunk_rows(bf16_twin, bf16_inputs):
    """The module forwards the wrappers find at call time (an adapter's, or one a test puts
    there like any instance forward) run on chunk rows only: the wrappers are outermost."""
    _with_lora(bf16_twin)
    block = bf16_twin.blocks[1]
    rows: dict[str, list[int]] = {}
    adapter = block.attn.qkv_proj.forward.__self__.adapter

    def counting(name, module):
        inner = module.forward  # the bypass adapter's forward where one is attached

        def forward(x):
            rows.setdefault(name, []).append(x.shape[0])
            return inner(x)

        module.forward = forward

    for name, module in (("qkv", block.attn.qkv_proj), ("out", block.attn.out_proj)):
        counting(name, module)
    for name, module in (("fc1", block.mlp.fc1), ("fc2", block.mlp.fc2)):
        module.register_forward_pre_hook(
            lambda _m, args, name=name: rows.setdefault(name, []).append(args[0].shape[0]))
    down_rows = []
    original_h = adapter.h
    adapter.h = lambda x, base: (down_rows.append(x.shape[0]), original_h(x, base))[1]
    config = ChunkingConfig(ffn_chunk=10, qkv_chunk=6, head_group=3)
    apply_activation_chunking(TwinPatcher(bf16_twin), config).apply_model(*bf16_inputs)
    assert max(rows["qkv"]) <= 6 and sum(rows["qkv"]) == 44
    assert max(rows["out"]) <= 6 and sum(rows["out"]) == 44
    assert max(rows["fc1"]) <= 10 and sum(rows["fc1"]) == 44
    assert max(rows["fc2"]) <= 10 and sum(rows["fc2"]) == 44
    assert max(down_rows) <= 6 and sum(down_rows) == 44
    # and the wrappers are gone after the forward: the modules' own forwards are back
    assert not hasattr(block.mlp.__dict__.get("forward"), "chunker")
    assert not hasattr(block.attn.qkv_proj.__dict__.get("forward"), "chunker")


def test_override_sees_each_head_group_and_output_is_unchanged(bf16_twin, bf16_inputs):
    calls = []

    def override(func, q, k, v, heads, **kwargs):
        calls.append((heads, q.shape[1], q.shape[2], q.is_contiguous()))
        return func(q, k, v, heads, **kwargs)

    base = TwinPatcher(bf16_twin).clone()
    base.set_model_optimized_attention(override)
    reference = base.apply_model(*bf16_inputs)
    calls.clear()
    patched = apply_activation_chunking(base, ChunkingConfig(head_group=3, qkv_chunk=8))
    assert _equal(patched.apply_model(*bf16_inputs), reference)
    # refiner (16 text rows, unpatched) then 3 blocks x heads 3 + 3 + 2 over 44 rows, strided
    assert [c[0] for c in calls] == [8] + [3, 3, 2] * 3
    assert all(c[0] == c[1] and not c[3] for c in calls)
    assert [c[2] for c in calls] == [16] + [44] * 9


def test_custom_attention_argument_is_called_and_mlp_still_chunked(bf16_twin, bf16_inputs):
    seen = []

    def patch(args, extra):
        block = bf16_twin.blocks[0]

        def attention(h, rope_freqs=None, transformer_options=None):
            seen.append(h.shape[0])
            return block.attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

        return extra["original_block"]({**args, "attention": attention})

    base = TwinPatcher(bf16_twin).clone()
    base.set_model_patch_replace(patch, "dit", "double_block", 0)
    reference = base.apply_model(*bf16_inputs)
    assert seen == [44]
    patched = apply_activation_chunking(base, ChunkingConfig(ffn_chunk=6, qkv_chunk=6))
    assert _equal(patched.apply_model(*bf16_inputs), reference)
    assert seen == [44, 44]


def _block_case(model, cfg, rows_tensor: bool):
    inputs = make_inputs(cfg, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=9, dtype=BF16)
    packed = model.pack(*inputs, transformer_options={})
    t_emb = torch.cat([packed.t_emb, packed.t_emb.flip(0) * 0.5])  # 4 timesteps -> 12 mod rows
    segments = list(packed.mod_segments)
    if rows_tensor:  # upstream's masked rows: one modulation row per token of the video segment
        a, b, _ = segments[2]
        segments[2] = (a, b, torch.arange(b - a) % 12)
    return packed.h, t_emb, segments, packed.rope_freqs


@pytest.mark.parametrize("rows_tensor", [False, True], ids=["row-index", "per-token-rows"])
def test_block_forward_matches_with_per_token_modulation_rows(bf16_twin, tiny_config,
                                                              rows_tensor):
    block = bf16_twin.blocks[2]
    x, t_emb, segments, rope = _block_case(bf16_twin, tiny_config, rows_tensor)
    reference = block.forward(x.clone(), t_emb, segments, rope)
    patched = apply_activation_chunking(TwinPatcher(bf16_twin), ChunkingConfig(
        ffn_chunk=11, qkv_chunk=7, head_group=3))
    runtime = get_chunking(patched)
    options = patched.model_options["transformer_options"]
    with runtime.wrapped():
        out = block.forward(x.clone(), t_emb, segments, rope, transformer_options=options)
    assert torch.equal(out, reference)
    assert runtime.chunkers[2].calls == {"attn.qkv_proj": 7, "attn.out_proj": 7, "mlp": 4}


def test_a_chunk_written_to_the_wrong_rows_is_caught(bf16_twin, bf16_inputs, monkeypatch):
    """Breaking the wrapper (chunks put back in the wrong row order) changes the output."""
    from h3_multigpu.chunking import wrappers

    reference = TwinPatcher(bf16_twin).apply_model(*bf16_inputs)

    original = wrappers.project_rows

    def reversed_rows(forward, x, ranges, **kwargs):
        out = original(forward, x, ranges, **kwargs)
        if len(ranges) > 1:  # the first chunk's rows and the last chunk's swapped
            (a0, b0), (a1, b1) = ranges[0], ranges[-1]
            n = min(b0 - a0, b1 - a1)
            first = out[a0:a0 + n].clone()
            out[a0:a0 + n] = out[a1:a1 + n]
            out[a1:a1 + n] = first
        return out

    monkeypatch.setattr(wrappers, "project_rows", reversed_rows)
    patched = apply_activation_chunking(TwinPatcher(bf16_twin), ChunkingConfig(ffn_chunk=7))
    assert not _equal(patched.apply_model(*bf16_inputs), reference)


def test_clip_segments_rebases_and_slices_token_rows():
    from h3_multigpu.sequence.plan import clip_segments

    rows = torch.arange(20, 30)
    segments = [(0, 4, 1), (4, 14, rows), (14, 20, 2)]
    assert clip_segments(segments, 0, 3) == [(0, 3, 1)]
    clipped = clip_segments(segments, 3, 9)
    assert [(a, b) for a, b, _ in clipped] == [(0, 1), (1, 6)]
    assert clipped[0][2] == 1 and torch.equal(clipped[1][2], torch.arange(20, 25))
    clipped = clip_segments(segments, 12, 20)
    assert [(a, b) for a, b, _ in clipped] == [(0, 2), (2, 8)]
    assert torch.equal(clipped[0][2], torch.tensor([28, 29])) and clipped[1][2] == 2


def test_project_rows_fills_one_buffer_exactly(bf16_twin):
    linear = bf16_twin.blocks[0].attn.qkv_proj
    attach_activation_lora(linear, 4, seed=1)
    x = torch.randn(37, linear.in_features, dtype=BF16)
    reference = linear(x)
    for chunk in (1, 5, 36, 37, 0):
        assert torch.equal(project_rows(linear, x, sizing.row_chunks(37, chunk, 0)), reference)


def test_adapter_hook_matches_comfyui_bypass_math(bf16_twin):
    linear = bf16_twin.blocks[0].mlp.fc1
    x = torch.randn(9, linear.in_features, dtype=BF16)
    plain = linear(x)
    hook = attach_activation_lora(linear, 3, alpha=1.5, multiplier=0.5, seed=4)
    up, down = hook.adapter.weights[:2]
    extra = torch.nn.functional.linear(torch.nn.functional.linear(x, down), up).mul_(0.25)
    assert torch.equal(linear(x), plain + extra)
    second = attach_activation_lora(linear, 7, seed=5)
    assert activation_adapters(linear) == (2, 7)
    second.eject()
    hook.eject()
    assert "forward" not in linear.__dict__ and activation_adapters(linear) == (0, 0)
    assert torch.equal(linear(x), plain)


def test_auto_is_off_on_cpu_and_sized_from_free_memory(bf16_twin, bf16_inputs, monkeypatch):
    base = TwinPatcher(bf16_twin)
    reference = base.apply_model(*bf16_inputs)
    patched = apply_activation_chunking(base, ChunkingConfig.from_strings())
    assert _equal(patched.apply_model(*bf16_inputs), reference)
    assert get_chunking(patched).chunkers[0].last_chunks == (0, 0, 0)
    # a device with almost no free memory: "auto" must chunk every phase, and stay exact; the
    # exactness floors are scaled down to this 44-row, 8-head model (the GPU's are 4096 rows and
    # 1024 query tiles per call: "auto" would not chunk a sequence this short at all)
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 0)
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 8)
    monkeypatch.setattr(common_floors, "MIN_QUERY_TILES_PER_CALL", 4)
    config = ChunkingConfig(ffn_chunk="auto", qkv_chunk="auto", head_group="auto",
                            headroom_bytes=0, blocks=(0,))
    patched = apply_activation_chunking(base, config)
    assert _equal(patched.apply_model(*bf16_inputs), reference)
    ffn, qkv, group = get_chunking(patched).chunkers[0].last_chunks
    # rows chunked as far as the floor lets them, every realised chunk at least 8 rows; the
    # smallest exact head group (4 of 8 heads, one 64-row query tile each)
    assert 8 <= ffn < 44 and 8 <= qkv < 44 and group == 4
    assert min(b - a for a, b in sizing.row_chunks(44, ffn)) >= 8
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 4096)
    monkeypatch.setattr(common_floors, "MIN_QUERY_TILES_PER_CALL", 1024)
    patched = apply_activation_chunking(base, config)
    patched.apply_model(*bf16_inputs)
    assert get_chunking(patched).chunkers[0].last_chunks == (0, 0, 0)


def test_apply_clones_and_records_status(bf16_twin):
    base = TwinPatcher(bf16_twin)
    patched = apply_activation_chunking(base, ChunkingConfig(ffn_chunk=16384, blocks=(0, 2)))
    assert not protocol.installed(base) and "h3_multigpu" not in base.model_options[
        "transformer_options"]
    assert patched.object_patches == {}  # the blocks' own forwards run
    assert sorted(get_chunking(patched).chunkers) == [0, 2]
    # chunking's own hooks only: the device guard is the composer's (the nodes' glue)
    assert [(r.feature, r.kind, r.where) for r in protocol.describe(patched)] == [
        ("chunking", "wrapper", "diffusion_model")]
    status = protocol.status_lines(patched)["chunking"]
    assert "ffn 16384 rows" in status and "blocks 0,2" in status and "qkv off" in status
    off = apply_activation_chunking(base, ChunkingConfig())
    assert not get_chunking(off).chunkers
    assert protocol.status_lines(off)["chunking"] == "off"
    # applied again: the new settings replace the old, one chunking wrapper, one override
    again = apply_activation_chunking(patched, ChunkingConfig(qkv_chunk=8, head_group=4))
    assert sorted(get_chunking(again).chunkers) == [0, 1, 2]
    assert len(protocol.wrappers_of(again, "diffusion_model", "chunking")) == 1
    assert [e.feature for e in protocol.installed(again)] == ["chunking"]
    removed = protocol.remove(again, "chunking")
    assert protocol.override_of(removed) is None
    assert protocol.wrappers_of(removed, "diffusion_model", "chunking") == []


def test_apply_refuses_bad_inputs_before_patching(bf16_twin):
    base = TwinPatcher(bf16_twin)
    with pytest.raises(ValueError, match="ChunkingConfig"):
        apply_activation_chunking(base, {"ffn_chunk": 8})
    with pytest.raises(ValueError, match="block index 3 is out of range"):
        apply_activation_chunking(base, ChunkingConfig(ffn_chunk=8, blocks=(1, 3)))
    with pytest.raises(ValueError, match="no DiT blocks"):
        apply_activation_chunking(TwinPatcher(torch.nn.Linear(2, 2)), ChunkingConfig())


@pytest.mark.parametrize("kwargs, name", [
    ({"ffn_chunk": -1}, "ffn_chunk"), ({"qkv_chunk": 2.5}, "qkv_chunk"),
    ({"head_group": True}, "head_group"), ({"ffn_chunk": "16384"}, "ffn_chunk"),
    ({"blocks": (0, -2)}, "blocks"), ({"headroom_bytes": -5}, "headroom_bytes"),
])
def test_config_rejects_bad_values_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ChunkingConfig(**kwargs)


def test_config_from_strings_and_plan():
    config = ChunkingConfig.from_strings(ffn_chunk=" 16384 ", qkv_chunk="auto", head_group="off")
    assert (config.ffn_chunk, config.qkv_chunk, config.head_group) == (16384, "auto", 0)
    assert ChunkingConfig.from_strings("16_384", "", "0").ffn_chunk == 16384
    for bad in ("-3", "lots", "1.5"):
        with pytest.raises(ValueError, match="ffn_chunk"):
            ChunkingConfig.from_strings(ffn_chunk=bad)
    plan = ChunkingConfig.from_plan({"ffn_chunk": 8192, "qkv_chunk": 0, "head_group": 14})
    assert (plan.ffn_chunk, plan.qkv_chunk, plan.head_group) == (8192, 0, 14)
    assert not ChunkingConfig().enabled and ChunkingConfig(head_group="auto").enabled


def test_full_config_block_is_recognised_on_meta():
    model = make_twin(TwinConfig.full(blocks=2, refiner_blocks=0), dtype=BF16, device="meta")
    patched = apply_activation_chunking(TwinPatcher(model), ChunkingConfig(ffn_chunk=16384))
    chunker = get_chunking(patched).chunkers[1]
    x = torch.empty(100, 5376, dtype=BF16, device="meta")
    dims = chunker.dims(x)
    assert (dims.hidden, dims.heads, dims.head_dim, dims.ffn) == (5376, 56, 128, 14336)


def test_activation_lora_follows_the_model_to_its_load_device(monkeypatch):
    """Adapters are attached where the model is built (ComfyUI: the offload device) and must
    compute where the activations are once the model moved (cuda:1 on the device: `mat2 is on
    cpu`). Here the model moves to "meta", and F.linear checks devices the way CUDA does."""
    linear = torch.nn.Linear(16, 24, dtype=BF16)
    hook = attach_activation_lora(linear, 4, seed=1)
    assert hook.adapter.weights[0].device.type == "cpu"
    linear.requires_grad_(False).to("meta")
    real_linear = torch.nn.functional.linear

    def device_checked_linear(x, weight, bias=None):
        if weight.device != x.device:
            raise RuntimeError(f"mat2 is on {weight.device}, input on {x.device}")
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", device_checked_linear)
    with torch.no_grad():
        out = linear(torch.empty(5, 16, dtype=BF16, device="meta"))
    assert out.device.type == "meta" and out.shape == (5, 24)
    hook.eject()
