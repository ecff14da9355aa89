"""apply_block_prefetch on the twin: bit-identical outputs, composition, status, validation."""

from __future__ import annotations

import pytest
import torch
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.block_weights import module_bytes
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch


def _twin6():
    cfg = TwinConfig.tiny(blocks=6, refiner_blocks=2)
    model = make_twin(cfg, seed=0)
    inputs = make_inputs(cfg, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)
    return model, inputs


@pytest.fixture
def twin6():
    return _twin6()


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def twin6_reference():
    model, inputs = _twin6()
    return TwinPatcher(model).apply_model(*inputs)


CASES = [(k, r, "auto", None) for k in (1, 2, 3) for r in (0, 2, 6)] + [
    (2, 2, "auto", 4.5), (1, 0, "auto", 4.5), (1, 0, "pageable", None), (3, 2, "pageable", None)]


@pytest.mark.parametrize("lookahead,resident,source,budget_blocks", CASES)
def test_streamed_output_is_bit_identical(twin6, twin6_reference, lookahead, resident, source,
                                          budget_blocks):
    model, inputs = twin6
    ref = twin6_reference
    base = TwinPatcher(model)
    # a budget of 4.5 blocks: the 2-buffer staging ring, then 2 blocks pinned, the rest staged
    budget = None if budget_blocks is None else int(budget_blocks * module_bytes(model.blocks[0]))
    patched = apply_block_prefetch(base, PrefetchConfig(
        resident_blocks=resident, lookahead=lookahead, pinned_budget_bytes=budget, source=source))
    for _ in range(2):  # the circular prefetch carries over from one step to the next
        assert same(patched.apply_model(*inputs), ref)
    prefetch = get_block_prefetch(patched)
    stats = prefetch.streamer.stats()
    streamed = 6 - resident + (2 if resident < 6 else 0)
    assert stats["streamed_blocks"] == streamed
    assert stats["slots"] == min(lookahead + 1, streamed)
    if budget is not None:
        assert stats["staged_blocks"] == streamed - 2  # 2 pinned, the rest staged
    if source == "pageable":
        assert stats["staged_blocks"] == streamed
    prefetch.close()
    assert same(base.apply_model(*inputs), ref)


def test_resident_blocks_are_spread_and_stay_in_place(twin6):
    model, inputs = twin6
    patched = apply_block_prefetch(TwinPatcher(model), PrefetchConfig(resident_blocks=2))
    prefetch = get_block_prefetch(patched)
    pointers = {i: model.blocks[i].mlp.fc1.weight.data_ptr() for i in range(6)}
    patched.apply_model(*inputs)
    assert prefetch.resident == (0, 3)
    assert model.blocks[0].mlp.fc1.weight.data_ptr() == pointers[0]  # untouched
    assert model.blocks[1].mlp.fc1.weight.data_ptr() != pointers[1]  # now in the arena
    assert "token_refiner.blocks.0" in prefetch.streamed_ids


def test_composes_with_a_block_patch_installed_before_and_after(twin6):
    model, inputs = twin6
    base = TwinPatcher(model)
    ref = base.apply_model(*inputs)
    seen: list[tuple[str, int, bool]] = []

    def spy(name):
        def patch(args, extra):
            i = args["transformer_options"]["block_index"]
            weight = model.blocks[i].attn.qkv_proj.weight
            prefetch = get_block_prefetch(patched)
            in_slot = any(s.data_ptr() <= weight.data_ptr() < s.data_ptr() + s.numel()
                          for s in prefetch.streamer.slots.buffers)
            seen.append((name, i, in_slot))
            return extra["original_block"](args)
        return patch

    before = base.clone()
    before.set_model_patch_replace(spy("before"), "dit", "double_block", 1)
    patched = apply_block_prefetch(before, PrefetchConfig(resident_blocks=0, lookahead=2))
    patched.set_model_patch_replace(_chain(spy("after"), patched, 2), "dit", "double_block", 2)
    assert same(patched.apply_model(*inputs), ref)
    # the earlier patch runs inside our bracket: the block's weights are in a slot then
    assert ("before", 1, True) in seen
    # a later patch that chains ours sees host weights before calling through
    assert ("after", 2, False) in seen


def _chain(patch, patcher, index):
    previous = patcher.model_options["transformer_options"]["patches_replace"]["dit"][
        ("double_block", index)]

    def chained(args, extra):
        patch(args, {"original_block": lambda a: a and {"img": a["img"]}})
        return previous(args, extra)

    return chained


def test_composes_with_an_object_patch_on_attention(twin6):
    model, inputs = twin6
    base = TwinPatcher(model)
    ref = base.apply_model(*inputs)
    calls = []
    chunked = base.clone()
    original = chunked.get_model_object("diffusion_model.blocks.4.mlp.forward")

    def mlp_forward(x):
        calls.append(x.shape[0])
        return torch.cat([original(x[:20]), original(x[20:])])  # row chunks: exact

    chunked.add_object_patch("diffusion_model.blocks.4.mlp.forward", mlp_forward)
    patched = apply_block_prefetch(chunked, PrefetchConfig(resident_blocks=1, lookahead=1))
    assert same(patched.apply_model(*inputs), ref)
    assert calls == [44]


def test_refiner_object_patch_chains_an_earlier_one(twin6):
    model, inputs = twin6
    base = TwinPatcher(model)
    ref = base.apply_model(*inputs)
    key = "diffusion_model.token_refiner.blocks.1.forward"
    earlier = base.clone()
    original = earlier.get_model_object(key)
    calls = []

    def refiner_forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    earlier.add_object_patch(key, refiner_forward)
    patched = apply_block_prefetch(earlier, PrefetchConfig(resident_blocks=3))
    assert same(patched.apply_model(*inputs), ref)
    assert calls == [1]


def test_lora_style_patch_after_first_run_is_picked_up(twin6):
    model, inputs = twin6
    base = TwinPatcher(model)
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=0, lookahead=2))
    first = patched.apply_model(*inputs)
    # a new Parameter object (ComfyUI's set_attr_param when it patches a LoRA)
    fc1 = model.blocks[4].mlp.fc1
    fc1.weight = torch.nn.Parameter(fc1.weight.detach() * 1.5, requires_grad=False)
    # an in-place patch (copy_to_param) plus the patch stamp ComfyUI sets after patching
    model.blocks[0].attn.out_proj.weight.data.mul_(0.5)
    base.model.current_weight_patches_uuid = "new-patches"
    ref = base.apply_model(*inputs)  # plain run reads the host copies, now patched
    out = patched.apply_model(*inputs)
    assert not same(out, first)
    assert same(out, ref)


def test_prefetch_flag_turns_comfyui_block_prefetch_off(twin6):
    model, inputs = twin6
    seen = []
    base = TwinPatcher(model).clone()
    # an inner wrapper (runs after ours) reads the options ComfyUI's block loop will see
    base.add_wrapper_with_key("diffusion_model", "spy", lambda ex, *a, **k: (
        seen.append(a[3].get("prefetch_dynamic_vbars")), ex(*a, **k))[1])
    base.model_options["transformer_options"]["prefetch_dynamic_vbars"] = True
    streamed = apply_block_prefetch(base, PrefetchConfig(resident_blocks=3))
    resident = apply_block_prefetch(base, PrefetchConfig(resident_blocks=6))
    _put_first(streamed)
    _put_first(resident)
    streamed.apply_model(*inputs)
    resident.apply_model(*inputs)
    assert seen == [False, True]  # only switched off when something streams


def _put_first(patcher):
    by_key = patcher.model_options["transformer_options"]["wrappers"]["diffusion_model"]
    ours = by_key.pop("h3_multigpu.prefetch")
    rest = dict(by_key)
    by_key.clear()
    by_key["h3_multigpu.prefetch"] = ours
    by_key.update(rest)


def test_status_is_recorded_without_touching_the_parent(twin6):
    model, _ = twin6
    base = TwinPatcher(model)
    base.model_options["transformer_options"]["h3_multigpu"] = {"chunking": "on"}
    patched = apply_block_prefetch(base, PrefetchConfig(resident_blocks=2, lookahead=3))
    status = protocol.status_lines(patched)
    assert status["chunking"] == "on"
    assert "2/6 blocks resident" in status["prefetch"] and "look-ahead 3" in status["prefetch"]
    assert "prefetch" not in base.model_options["transformer_options"]["h3_multigpu"]
    assert "wrappers" not in base.model_options["transformer_options"]


@pytest.mark.parametrize("kwargs,match", [
    ({"resident_blocks": -1}, "resident_blocks=-1"),
    ({"resident_blocks": "all"}, "resident_blocks='all'"),
    ({"lookahead": 0}, "lookahead=0"),
    ({"pinned_budget_bytes": -5}, "pinned_budget_bytes=-5"),
    ({"source": "disk"}, "source='disk'"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefetchConfig(**kwargs)


def test_apply_refuses_before_anything_moves(twin6):
    model, _ = twin6
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="resident_blocks=7 but the model has 6"):
        apply_block_prefetch(TwinPatcher(model), PrefetchConfig(resident_blocks=7))
    with pytest.raises(ValueError, match="source='pinned' needs"):
        apply_block_prefetch(TwinPatcher(model), PrefetchConfig(
            resident_blocks=0, source="pinned", pinned_budget_bytes=1000))
    assert pointers == [p.data_ptr() for p in model.parameters()]


def test_from_plan_reads_the_plan_fields():
    class Planned:
        resident_blocks, lookahead, pinned_budget_bytes = 20, 3, 1 << 34

    config = PrefetchConfig.from_plan(Planned(), source="pageable")
    assert (config.resident_blocks, config.lookahead, config.pinned_budget_bytes,
            config.source) == (20, 3, 1 << 34, "pageable")


def test_auto_on_a_cpu_root_keeps_every_block_resident(twin6, twin6_reference):
    model, inputs = twin6
    patched = apply_block_prefetch(TwinPatcher(model), PrefetchConfig())
    assert same(patched.apply_model(*inputs), twin6_reference)
    prefetch = get_block_prefetch(patched)
    assert prefetch.resident == tuple(range(6)) and not prefetch.streamed_ids
    assert "resident auto" in protocol.status_lines(patched)[
        "prefetch"]
