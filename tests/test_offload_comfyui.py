"""The block prefetcher inside a real ComfyUI: the real MiniMaxH3 through the real ModelPatcher
and sampler path, compared with ComfyUI's own unpatched output, bit for bit (CPU, fp32).

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_offload_comfyui.py

Every case streams (a count of host->slot copies says so): 1 of 6 DiT blocks resident, the
other 5 and the 2 token-refiner blocks streamed with look-ahead 2 (3 device slots).
"""

from __future__ import annotations

import gc

import pytest
import torch
from comfyui_h3 import (
    TinyH3Config,
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    recording_lowvram_patches,
    run_like_sampler,
    unload_all,
    with_lora,
)

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common.arena import HostArena, live_host_bytes
from h3_multigpu.common.block_weights import leaves_of
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui")]

CFG = TinyH3Config(blocks=6)
STREAM = PrefetchConfig(resident_blocks=1, lookahead=2)
DIT_STREAMED = [f"blocks.{i}" for i in range(1, 6)]
REFINER = ["token_refiner.blocks.0", "token_refiner.blocks.1"]
THREE_STEPS = (0.9, 0.6, 0.3, 0.0)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def prefetched(patcher, config=STREAM):
    out = apply_block_prefetch(patcher, config)
    prefetch = get_block_prefetch(out)  # found on a real ModelPatcher (wrappers in .wrappers)
    assert prefetch is not None
    return out, prefetch


def copies(prefetch) -> dict[str, int]:
    return dict(prefetch.streamer.copies)


@pytest.mark.parametrize("adaln", ["curve", "full"])
@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "keyframe+audio_mask"])
def test_streamed_equals_comfyui_unpatched(adaln, conditioned):
    cfg = TinyH3Config(blocks=6, adaln=adaln)
    base = make_tiny_h3(cfg, seed=0)
    inputs = make_inputs(cfg, keyframe=conditioned, audio_mask=conditioned)
    ref = run_like_sampler(base, inputs, sigmas=THREE_STEPS)
    patcher, prefetch = prefetched(base)
    out = run_like_sampler(patcher, inputs, sigmas=THREE_STEPS)
    assert same(out, ref)
    assert prefetch.streamed_ids == frozenset(DIT_STREAMED + REFINER)
    counted = copies(prefetch)
    # each DiT block once per step (the last step's look-ahead may add one), the refiner once
    assert all(3 <= counted[b] <= 4 for b in DIT_STREAMED), counted
    assert all(counted[b] == 1 for b in REFINER), counted
    assert same(run_like_sampler(patcher, inputs, sigmas=THREE_STEPS), ref)  # and again


def test_refiner_streams_once_per_run_outside_the_step_order():
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    ref = run_like_sampler(base, inputs, sigmas=THREE_STEPS)
    patcher, prefetch = prefetched(base)
    for run in (1, 2):
        assert same(run_like_sampler(patcher, inputs, sigmas=THREE_STEPS), ref)
        assert all(copies(prefetch)[b] == run for b in REFINER)
        # the look-ahead at each step boundary (and at the end of the run) went to DiT blocks
        holders = {h for h in prefetch.streamer.slots.holder if h is not None}
        assert holders and holders <= set(DIT_STREAMED), holders
    assert prefetch.streamer.prologue == REFINER and prefetch.streamer.cycle == DIT_STREAMED


def test_refiner_weight_changes_outside_the_forward_are_seen():
    """A LoRA on the refiner only: ComfyUI patches and unpatches it between runs, and the
    refiner runs in extra_conds before any DiT forward."""
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    sd = {k: v for k, v in make_lora_state_dict(base, rank=4, seed=3).items()
          if ".token_refiner." in k}
    lora = with_lora(base, sd)
    ref, ref_lora = run_like_sampler(base, inputs), run_like_sampler(lora, inputs)
    assert not same(ref, ref_lora)
    patcher, prefetch = prefetched(base)
    patched_lora = with_lora(patcher, sd)
    for p, r in [(patcher, ref), (patched_lora, ref_lora), (patcher, ref),
                 (patched_lora, ref_lora), (patcher, ref)]:
        assert same(run_like_sampler(p, inputs), r)
    assert all(copies(prefetch)[b] == 5 for b in REFINER)


@pytest.mark.parametrize("order", ["prefetch_then_lora", "lora_then_prefetch"])
def test_lora_on_off_on_full_load(order):
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG, keyframe=True, audio_mask=True)
    sd = make_lora_state_dict(base, rank=4, seed=3)
    ref, ref_lora = run_like_sampler(base, inputs), run_like_sampler(with_lora(base, sd), inputs)
    unload_all()
    plain, prefetch = prefetched(base)
    lora = with_lora(plain, sd) if order == "prefetch_then_lora" else \
        apply_block_prefetch(with_lora(base, sd), STREAM)
    assert get_block_prefetch(lora) is prefetch  # same model, same settings: one set of copies
    before = prefetch.streamer.detached_backups if prefetch.streamer else 0
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora), (plain, ref)]:
        assert same(run_like_sampler(p, inputs), r)
    # ComfyUI backed up weights bound to the host copies; each kept its own bytes
    assert prefetch.streamer.detached_backups > before


def test_lora_on_off_on_lowvram():
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG, keyframe=True, audio_mask=True)
    sd = make_lora_state_dict(base, rank=4, seed=3)
    plain, prefetch = prefetched(base)
    prefetch.ensure_resolved()
    budget = prefetch.device_footprint_bytes() // 3  # part loads, part LowVramPatch
    lora = with_lora(plain, sd)
    ref = run_like_sampler(base, inputs, lowvram_bytes=budget)
    ref_lora = run_like_sampler(with_lora(base, sd), inputs, lowvram_bytes=budget)
    unload_all()
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora), (plain, ref)]:
        assert same(run_like_sampler(p, inputs, lowvram_bytes=budget), r)
        if p is lora:
            streamed_keys = [k for k in lora.backup if any(f".{b}." in k for b in DIT_STREAMED)]
            on_the_fly = [m for b in DIT_STREAMED for m in prefetch.module(b).modules()
                          if getattr(m, "weight_function", None)]
            # both of ComfyUI's LoRA paths ran on streamed blocks: patched at load (backed up)
            # and LowVramPatch on use
            assert streamed_keys and on_the_fly and lowvram_patched_modules(lora) > 0
    assert prefetch.comfy_lowvram_modules > 0  # noted for the status/log


def test_lowvram_lora_bf16_matches_comfyui_call_for_call(monkeypatch):
    """bf16, where ComfyUI's two LoRA paths round differently (patched at load in fp32, or
    LowVramPatch on use in bf16): each streamed run has the same modules lowvram as ComfyUI's
    own run, and each LowVramPatch call gets the same raw stored weight.

    ComfyUI's unload_all_models frees only its current device; on 2 GPUs (cuda:0 current, DiT
    on cuda:1) it leaves the model loaded between runs. Made a no-op here, it does the same to
    the CPU model: the harness must still start each lowvram run from an unloaded model."""
    import comfy.model_management

    cfg = TinyH3Config(blocks=6, dtype=torch.bfloat16)
    base = make_tiny_h3(cfg, seed=0)
    inputs = make_inputs(cfg, keyframe=True, audio_mask=True)
    sd = make_lora_state_dict(base, rank=4, seed=3)
    plain, prefetch = prefetched(base)
    prefetch.ensure_resolved()
    budget = prefetch.device_footprint_bytes() // 3

    def run(patcher):
        with recording_lowvram_patches() as calls:
            out = run_like_sampler(patcher, inputs, lowvram_bytes=budget)
        return out, lowvram_patched_modules(patcher), [(k, d, s.item()) for k, d, s in calls]

    ref, ref_lora = run(base), run(with_lora(base, sd))
    assert ref_lora[1] > 0 and ref_lora[2]  # LowVramPatch ran on use
    unload_all()
    monkeypatch.setattr(comfy.model_management, "unload_all_models", lambda: None)
    lora = with_lora(plain, sd)
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora)]:
        out, patched, calls = run(p)
        assert patched == r[1] and calls == r[2]
        assert same(out, r[0])
    assert prefetch.streamer.copies["blocks.1"] > 0


def test_lora_on_off_on_in_place_updates():
    base = make_tiny_h3(CFG, seed=0)
    base.weight_inplace_update = True  # ComfyUI writes patched weights into the tensors
    inputs = make_inputs(CFG, keyframe=True, audio_mask=True)
    sd = make_lora_state_dict(base, rank=4, seed=3)
    ref, ref_lora = run_like_sampler(base, inputs), run_like_sampler(with_lora(base, sd), inputs)
    unload_all()
    plain, prefetch = prefetched(base)
    lora = with_lora(plain, sd)
    assert lora.weight_inplace_update
    for p, r in [(plain, ref), (lora, ref_lora), (plain, ref), (lora, ref_lora), (plain, ref)]:
        assert same(run_like_sampler(p, inputs), r)


def test_loader_leaves_streamed_blocks_in_host_memory(monkeypatch):
    """ComfyUI's loader moves modules with Module.to (-> _apply): streamed blocks' modules
    must never take that path, and their LoRA-patched weights go into the host copy."""
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    sd = make_lora_state_dict(base, rank=4, seed=3)
    plain, prefetch = prefetched(base)
    lora = with_lora(plain, sd)
    run_like_sampler(plain, inputs)
    streamed_modules = {id(m) for b in prefetch.streamed_ids for m in prefetch.module(b).modules()}
    resident_modules = {id(m) for m in prefetch.module("blocks.0").modules()}
    moved: list[int] = []
    original = torch.nn.Module._apply

    def spy(module, fn, recurse=True):
        moved.append(id(module))
        return original(module, fn, recurse)

    monkeypatch.setattr(torch.nn.Module, "_apply", spy)
    registrations = prefetch.streamer.registrations
    run_like_sampler(lora, inputs)  # unpatch + load with the LoRA
    assert resident_modules & set(moved)  # the loader did move things
    assert not streamed_modules & set(moved)
    # every patched streamed weight went straight into its host copy (adopted), none waited on
    # the device for the refresh
    patched = [k for k in lora.backup if any(f".{b}." in k for b in prefetch.streamed_ids)]
    assert patched and prefetch.streamer.registrations - registrations == len(patched)
    for block_id in prefetch.streamed_ids:
        host = prefetch.streamer.host[block_id].flat
        assert prefetch.streamer.weights[block_id].is_bound_to(host)
    # ComfyUI counts only what goes on the device
    assert lora.model_size() == prefetch.device_footprint_bytes() < \
        sum(t.nelement() * t.element_size() for t in base.model.state_dict().values())
    assert lora.loaded_size() == lora.model_size()


def test_a_registration_failure_does_not_break_the_prefetcher(monkeypatch):
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    ref = run_like_sampler(base, inputs)
    weights_before = {k: v.clone() for k, v in base.model.diffusion_model.state_dict().items()}
    patcher, prefetch = prefetched(base)
    original, calls = HostArena.allocate, []

    def failing(self, nbytes, want_direct):
        calls.append(nbytes)
        if len(calls) == 3:
            raise MemoryError("host memory exhausted (injected)")
        return original(self, nbytes, want_direct)

    monkeypatch.setattr(HostArena, "allocate", failing)
    with pytest.raises(MemoryError, match="injected"):
        run_like_sampler(patcher, inputs)
    # the two blocks already moved got their own storage back, with their bytes
    for k, v in base.model.diffusion_model.state_dict().items():
        assert torch.equal(v, weights_before[k]), k
    assert not prefetch.streamer.prepared
    assert same(run_like_sampler(patcher, inputs), ref)  # the next run starts over and works
    assert prefetch.streamer.prepared and len(calls) == 3 + len(DIT_STREAMED + REFINER)


def _host_footprint(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages the model's tensors live in (host copies included)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        for _, leaf in leaves_of(tensor):
            storage = leaf.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def live_host() -> int:
    """Host bytes of our live buffers, after a collection: buffers of earlier tests held in
    reference cycles would otherwise be freed by whichever collection runs mid-test."""
    gc.collect()
    return live_host_bytes()[0]


def test_runs_lora_changes_and_reloads_keep_memory_flat():
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    plain, prefetch = prefetched(base)
    lora_a = with_lora(plain, make_lora_state_dict(base, rank=4, seed=3))
    lora_b = with_lora(plain, make_lora_state_dict(base, rank=8, seed=5), strength=0.5)
    run_like_sampler(plain, inputs)
    host, model_bytes = live_host(), _host_footprint(base.model)
    for p in (plain, lora_a, lora_b, plain, lora_a, plain):
        run_like_sampler(p, inputs)
        run_like_sampler(p, inputs)  # two runs in a row
    assert live_host() == host
    assert _host_footprint(base.model) == model_bytes and not plain.backup
    unload_all()  # ComfyUI unloads the model: slots go, the host copies stay the model's copy
    assert prefetch.streamer.slots is None
    assert live_host() == host and _host_footprint(base.model) == model_bytes
    run_like_sampler(lora_b, inputs)
    unload_all()  # unloaded while patched: restored backups are taken into the host copies
    assert live_host() == host and _host_footprint(base.model) == model_bytes


def test_other_settings_take_over_the_host_copies_and_dropping_the_model_frees_them():
    gc.collect()
    start = live_host_bytes()[0]
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    ref = run_like_sampler(base, inputs)
    one, first = prefetched(base, STREAM)
    two, second = prefetched(base, PrefetchConfig(resident_blocks=2, lookahead=1))
    assert first is not second
    sizes = []
    for p in (one, two, one, two):
        assert same(run_like_sampler(p, inputs), ref)
        sizes.append(live_host_bytes()[0] - start)
    # only one prefetcher's host copies exist at a time (2 resident streams 2+2 blocks, 1: 3+2)
    assert sizes[0] == sizes[2] > sizes[1] == sizes[3] > 0
    other = make_tiny_h3(CFG, seed=1)  # model switched
    other_patcher = apply_block_prefetch(other, STREAM)
    run_like_sampler(other_patcher, inputs)
    del base, one, two, first, second, other, other_patcher, p
    unload_all()
    gc.collect()
    assert live_host_bytes()[0] == start


def test_dynamic_vram_patcher_is_left_to_comfyui():
    base = make_tiny_h3(CFG, seed=0)
    inputs = make_inputs(CFG)
    ref = run_like_sampler(base, inputs)
    dynamic = base.clone()
    dynamic.is_dynamic = lambda: True  # what ComfyUI's ModelPatcherDynamic answers
    patched = apply_block_prefetch(dynamic, STREAM)
    assert get_block_prefetch(patched) is None
    line = protocol.status_lines(patched)["prefetch"]
    assert line.startswith("off: ComfyUI's DynamicVRAM")
    assert same(run_like_sampler(patched, inputs), ref)


def test_status_line_says_who_streams():
    base = make_tiny_h3(CFG, seed=0)
    patched, _ = prefetched(base)
    line = protocol.status_lines(patched)["prefetch"]
    assert "streaming: this prefetcher" in line and "token refiner streamed once" in line
