"""Bad days on ComfyUI's real H3 model and sampler path (CPU): out of memory mid-step and a
cancel mid-step, with Dual-Sage (host relay), the block prefetcher (every block streamed, past
its pinned budget: through the staging ring and its worker thread) and chunking applied the way
the nodes apply them (`nodes.features.apply_feature`, which installs the device and OOM guards).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_bad_days_comfyui.py

Fault injection: a forward pre-hook on one DiT block's `attn.qkv_proj` raises torch's
OutOfMemoryError (or sets ComfyUI's cancel flag, `interrupt_current_processing(True)`) at a
chosen sampling step; everything between it and the test is ComfyUI's (CFGGuider.outer_sample,
its cleanup, the pack's wrappers). What the pack holds is counted through its registries
(`guard.oom.pack_memory`: Dual-Sage workspaces, prefetch slots and staging rings, live host
buffers, the threads it started). "Exact" is equality with the same model unpatched.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types

import pytest
import torch
from comfyui_h3 import (
    TinyH3Config,
    make_inputs,
    make_tiny_h3,
    record_cuda_pin_calls,
    run_like_sampler,
    unload_all,
)

from h3_multigpu.dual_sage import get_sharded_attention
from h3_multigpu.guard.oom import PackOutOfMemoryError, pack_memory
from h3_multigpu.nodes.features import CONFIGS, apply_feature
from h3_multigpu.offload import get_block_prefetch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]

CONFIG = TinyH3Config(heads=8, blocks=3)
SIGMAS = (0.9, 0.6, 0.3, 0.0)  # three sampling steps
LONG, SHORT = (3, 8, 12), (3, 4, 6)  # latent frames, height, width: the failing and the next


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def with_pack(patcher, *, chunking: bool = False):
    """Dual-Sage over two CPU helpers through the host relay, then every block streamed with a
    pinned budget of one block (the rest through the staging ring), as the nodes apply them."""
    from h3_multigpu.common.block_weights import module_bytes
    from h3_multigpu.dual_sage import DualSageConfig
    from h3_multigpu.offload import PrefetchConfig

    block = module_bytes(patcher.model.diffusion_model.blocks[0])
    model = apply_feature(patcher, "dual_sage", DualSageConfig(
        helpers=("cpu", "cpu"), min_tokens=0, transport="host"))
    if chunking:
        model = apply_feature(model, "chunking", CONFIGS["chunking"](
            ffn_chunk="16", qkv_chunk="16", head_group="auto"))
    return apply_feature(model, "prefetch", PrefetchConfig(
        resident_blocks=0, pinned_budget_bytes=block, staging_buffers=2))


class Fault:
    """A pre-hook on DiT block `block` that acts when the block starts its `step`-th sampling
    step (1-based; its weights are in a slot by then): raise torch's OutOfMemoryError, or set
    ComfyUI's cancel flag. `after` counts the DiT linears entered after the fault."""

    def __init__(self, patcher, *, block: int, step: int, action: str):
        self.blocks = list(patcher.model.diffusion_model.blocks)
        self.block, self.step, self.action = block, step, action
        self.calls = 0
        self.held = None  # what the pack held when the fault struck
        self.after = 0
        self._handles = []

    def _hook(self, module, args, kwargs):
        self.calls += 1
        if self.calls != self.step:
            return
        self.held = pack_memory()
        if self.action == "oom":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 4.18 GiB. GPU 1 has a total capacity of "
                "31.98 GiB of which 1.02 GiB is free.")
        import comfy.model_management as mm
        mm.interrupt_current_processing(True)

    def _count(self, module, args):
        if self.held is not None:
            self.after += 1

    def __enter__(self) -> Fault:
        self._handles.append(self.blocks[self.block].register_forward_pre_hook(
            self._hook, with_kwargs=True))
        for blk in self.blocks:
            for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
                self._handles.append(blk.get_submodule(name).register_forward_pre_hook(
                    self._count))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


def staging_idle(patcher) -> bool:
    """No fill of the prefetcher's staging ring is pending or still running."""
    streamer = get_block_prefetch(patcher).streamer
    if streamer is None or streamer.staging is None:
        return True
    futures = [f for _, f in streamer.staging._pending.values()]
    done, _ = concurrent.futures.wait(futures, timeout=10)
    return len(done) == len(futures)


def pack_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("h3-")}


def assert_exact(out, reference, good_day, patcher, short_inputs, chunking: bool) -> None:
    """The run after the bad day equals ComfyUI unpatched; with chunking, where this CPU's
    GEMMs give a 16-row slice the whole call's bits (`kernels_row_and_head_independent`: with
    two threads some CPUs' fp32 kernels do not, so no chunked run can equal unpatched there),
    and always the same pack's good-day run bit for bit (the bad day left nothing behind)."""
    from comfyui_h3 import CallCounter, kernels_row_and_head_independent

    if not chunking:
        assert same(out, reference)
        return
    assert same(out, good_day)
    with CallCounter(patcher) as counts:
        run_like_sampler(patcher, short_inputs, sigmas=SIGMAS[:2])
    if kernels_row_and_head_independent(patcher, counts.rows[0], ffn_chunk=16, qkv_chunk=16,
                                        head_group=0):
        assert same(out, reference)


# ------------------------------------------------------------------------------ out of memory
@pytest.mark.parametrize("chunking", [False, True], ids=["dual_sage+prefetch", "+chunking"])
def test_oom_mid_step_frees_the_pack_and_the_next_shorter_run_is_exact(chunking):
    import comfy.model_management as mm

    patcher = make_tiny_h3(CONFIG, seed=0)
    long_inputs = make_inputs(CONFIG, latent_thw=LONG, audio_t=5)
    short_inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5, seed=2)
    reference = run_like_sampler(patcher, short_inputs, sigmas=SIGMAS)
    unload_all()
    packed = with_pack(patcher, chunking=chunking)
    threads_before = pack_threads()
    with Fault(packed, block=1, step=2, action="oom") as f, \
            pytest.raises(torch.OutOfMemoryError) as caught:
        run_like_sampler(packed, long_inputs, sigmas=SIGMAS)
    exc = caught.value
    # the pack held device buffers when it ran out (so the release below is the pack's own)
    assert f.held is not None and f.held.workspaces >= 1 and f.held.workspace_bytes > 0
    assert f.held.slot_bytes > 0 and f.held.staging_bytes > 0
    # ComfyUI's handler still sees an OOM, and shows torch's message first, then ours
    assert isinstance(exc, PackOutOfMemoryError) and mm.is_oom(exc)
    text = str(exc)
    assert text.startswith("CUDA out of memory. Tried to allocate 4.18 GiB")
    assert "out of memory on gpu:1 (31.98 GiB) at sampling step 2 of 3" in text, text
    assert "asking for 4.18 GiB more" in text and "dual_sage" in text and "prefetch" in text
    assert f"{LONG[2] * 16}x{LONG[1] * 16} px" in text
    for advice in ("shorter clip", "Activation Chunking", "fewer resident_blocks",
                   "h3-multigpu plan --gpus auto --width 192 --height 128"):
        assert advice in text, advice
    # everything the pack keeps between calls is freed; no thread of ours is left
    held = pack_memory()
    assert held.workspaces == held.workspace_bytes == 0
    assert held.slot_bytes == held.staging_bytes == 0
    assert get_block_prefetch(packed).streamer._running == {}
    assert pack_threads() <= threads_before  # the staging worker was shut down
    mm.unload_all_models()  # what execution.py does next
    # the next, shorter run in the same process succeeds and is exact
    out = run_like_sampler(packed, short_inputs, sigmas=SIGMAS)
    good_day = None
    if chunking:  # a fresh pack of the same features, on a day without faults
        unload_all()
        good_day = run_like_sampler(with_pack(patcher, chunking=True), short_inputs,
                                    sigmas=SIGMAS)
    assert_exact(out, reference, good_day, patcher, short_inputs, chunking)
    shard = get_sharded_attention(packed)
    assert shard.routes["split"] > 0  # Dual-Sage really ran (and its helpers did not fall back)
    assert "fallback" not in shard.routes
    assert get_block_prefetch(packed).streamer.stats()["copies"] > 0


def test_a_non_oom_error_passes_through_unchanged():
    patcher = with_pack(make_tiny_h3(CONFIG, seed=0))
    inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5)
    module = patcher.model.diffusion_model.blocks[0].attn.qkv_proj

    def hook(module, args):
        raise ValueError("not a memory problem")

    handle = module.register_forward_pre_hook(hook)
    try:
        with pytest.raises(ValueError, match="^not a memory problem$"):
            run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    finally:
        handle.remove()


# ------------------------------------------------------------------------------ cancel
@pytest.mark.parametrize("chunking", [False, True], ids=["dual_sage+prefetch", "+chunking"])
def test_cancel_mid_step_returns_promptly_and_the_next_run_is_exact(chunking):
    import comfy.model_management as mm

    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5)
    reference = run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    unload_all()
    packed = with_pack(patcher, chunking=chunking)
    warm = run_like_sampler(packed, inputs, sigmas=SIGMAS)  # rings and the staging worker exist
    threads_warm = pack_threads()
    try:
        with Fault(packed, block=1, step=2, action="cancel") as f, \
                pytest.raises(mm.InterruptProcessingException):
            run_like_sampler(packed, inputs, sigmas=SIGMAS)
    finally:
        mm.interrupt_current_processing(False)
    # promptly: the cancel is seen by the very next layer (its own qkv's comfy op)
    assert f.held is not None and f.after <= 1, f.after
    assert not mm.processing_interrupted()  # consumed, as ComfyUI's own check does
    assert get_block_prefetch(packed).streamer._running == {}
    assert staging_idle(packed)  # no fill left waiting on an event
    assert pack_threads() <= threads_warm
    held = pack_memory()
    assert held.workspaces == 0  # ComfyUI's cleanup freed the Dual-Sage lanes
    out = run_like_sampler(packed, inputs, sigmas=SIGMAS)
    assert_exact(out, reference, warm, patcher, inputs, chunking)


def test_cancel_between_streamed_blocks_is_seen_before_the_next_copy(monkeypatch):
    """The prefetcher checks ComfyUI's cancel before it copies a streamed block in: set between
    two blocks (the end of block 0), no copy for block 1 is issued in that step."""
    import comfy.model_management as mm

    patcher = with_pack(make_tiny_h3(CONFIG, seed=0))
    inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5)
    run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    prefetch = get_block_prefetch(patcher)
    streamer = prefetch.streamer
    begun: list[str] = []
    begin, end = streamer.begin, streamer.end

    def end_then_cancel(block_id):
        end(block_id)
        if block_id == "blocks.0":
            mm.interrupt_current_processing(True)

    def record_begin(block_id):
        if block_id.startswith("blocks."):
            begun.append(block_id)
        begin(block_id)

    monkeypatch.setattr(streamer, "begin", record_begin)
    monkeypatch.setattr(streamer, "end", end_then_cancel)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    finally:
        mm.interrupt_current_processing(False)
    assert begun == ["blocks.0"], begun  # block 1 never began: no wait for its copy


# ------------------------------------------------------------------------------ decode cancel
def test_cancel_seen_by_a_decode_helper_thread_stops_the_decode(monkeypatch):
    """ComfyUI clears its cancel flag as it raises: when a helper thread's own layer is the one
    that sees it, the split decode must still end as cancelled (not redo the helper's windows
    on the root as after a failure), leave no decode thread behind, and decode exactly next."""
    import comfy.ldm.minimax.vae as h3_vae
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    import comfy.utils
    from test_decode_comfyui import _latent, _same_bits, _tiny_vae

    from h3_multigpu.decode import executor as executor_mod
    from h3_multigpu.decode.apply import MultiGPUDecodeConfig, apply_multi_gpu_decode, find_patch

    ns = types.SimpleNamespace(sd=comfy.sd, h3_vae=h3_vae, ops=comfy.ops, mm=mm,
                               utils=comfy.utils)
    real = executor_mod.make_replica
    armed = {"on": True, "calls": 0}

    def cancelling_replica(model, device, move):
        replica = real(model, device, move)

        def cancel(module, args):
            armed["calls"] += 1
            if armed["on"] and armed["calls"] == 2:  # mid-way through the helper's range
                mm.interrupt_current_processing(True)
                mm.throw_exception_if_processing_interrupted()  # what its next comfy op does

        replica.decoder.register_forward_pre_hook(cancel)
        return replica

    monkeypatch.setattr(executor_mod, "make_replica", cancelling_replica)
    vae = _tiny_vae(ns)
    z = _latent(22)
    expected = vae.decode(z)
    patched, _ = apply_multi_gpu_decode(vae, MultiGPUDecodeConfig(helpers=("cpu",)))
    try:
        with pytest.raises(mm.InterruptProcessingException):
            patched.decode(z)
    finally:
        mm.interrupt_current_processing(False)
    assert armed["calls"] >= 2
    assert not any(t.name.startswith("h3-decode") for t in threading.enumerate())
    armed["on"] = False
    out = patched.decode(z)
    assert _same_bits(out, expected)
    assert not find_patch(patched).last_report.failed



# ------------------------------------------------------------------------------ pinned budget
@pytest.fixture
def comfy_pins(monkeypatch):
    """ComfyUI pinning on, with CUDA's registration calls recorded (ComfyUI's own pin_memory /
    unpin_memory and their bookkeeping run), and the exchange's relay slots page-locked as on
    a GPU."""
    from h3_multigpu.exchange import pinned

    registered = record_cuda_pin_calls(monkeypatch)
    monkeypatch.setattr(pinned, "should_pin", lambda *devices: True)
    return registered


def test_dual_sage_relay_slots_are_booked_in_comfyuis_pin_budget(comfy_pins, monkeypatch):
    import comfy.model_management as mm

    from h3_multigpu.dual_sage import DualSageConfig

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 30)
    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5)
    reference = run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    packed = apply_feature(patcher, "dual_sage", DualSageConfig(
        helpers=("cpu", "cpu"), min_tokens=0, transport="host"))
    seen = []
    module = patcher.model.diffusion_model.blocks[1]
    handle = module.register_forward_pre_hook(
        lambda m, a: seen.append((pack_memory(), mm.TOTAL_PINNED_MEMORY, dict(comfy_pins))))
    try:
        out = run_like_sampler(packed, inputs, sigmas=SIGMAS)
    finally:
        handle.remove()
    assert same(out, reference)
    held, total, registered = seen[-1]
    # two helpers x (2 upload + 2 download slots), all booked through ComfyUI's pin_memory
    assert held.workspaces == 2 and held.booked_bytes == held.pinned_bytes == total > 0
    assert sum(registered.values()) == total and len(registered) == 8
    # ComfyUI's cleanup after the run gave every byte back
    assert mm.TOTAL_PINNED_MEMORY == 0 and not comfy_pins and not mm.PINNED_MEMORY


def test_relay_slots_past_comfyuis_budget_stay_pageable_and_exact(comfy_pins, monkeypatch):
    import comfy.model_management as mm

    from h3_multigpu.dual_sage import DualSageConfig

    other = 5 << 20  # pinned by ComfyUI itself; 4 KiB left: no relay slot fits
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", other)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", other + 4096)
    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, latent_thw=SHORT, audio_t=5)
    reference = run_like_sampler(patcher, inputs, sigmas=SIGMAS)
    packed = apply_feature(patcher, "dual_sage", DualSageConfig(
        helpers=("cpu", "cpu"), min_tokens=0, transport="host"))
    out = run_like_sampler(packed, inputs, sigmas=SIGMAS)
    assert same(out, reference)
    assert mm.TOTAL_PINNED_MEMORY == other and not comfy_pins  # nothing past the budget
    shard = get_sharded_attention(packed)
    assert shard.routes["split"] > 0 and "fallback" not in shard.routes


def test_sequence_link_relay_slots_are_booked_and_given_back(comfy_pins, monkeypatch):
    import comfy.model_management as mm

    from h3_multigpu.exchange.links import Link
    from h3_multigpu.exchange.transport import TransportMode

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 30)
    cpu = torch.device("cpu")
    link = Link(cpu, cpu, TransportMode.HOST)
    link.reserve(10_000)
    first = mm.TOTAL_PINNED_MEMORY
    assert first >= 2 * 10_000 and len(comfy_pins) == 2
    src = torch.arange(6000, dtype=torch.float32)
    dst = torch.empty_like(src)
    link.copy(dst, src)  # 24,000 bytes: the slots grow once, the old ones are given back
    assert torch.equal(dst, src)
    assert len(comfy_pins) == 2 and mm.TOTAL_PINNED_MEMORY >= 2 * 24_000 > first
    link.close()
    assert mm.TOTAL_PINNED_MEMORY == 0 and not comfy_pins


# ------------------------------------------------------------------------------ ten runs
def test_ten_runs_in_a_row_keep_memory_flat_and_equal_fresh_loads():
    """Two workflows alternating (a PASS1-like and a PASS2-like size, different frame counts),
    the LoRA changed every run, the model switched every two, Dual-Sage + streaming on. Each
    output equals the same job on a fresh, unpatched load of its model; after the first four
    runs (each model, size and LoRA seen) the pack's live objects do not grow and the host
    memory stays within the stated tolerance."""
    import gc
    import tracemalloc

    import psutil
    from comfyui_h3 import make_lora_state_dict, with_lora

    sizes = [((3, 4, 6), 5), ((4, 8, 10), 7)]  # PASS1-like and PASS2-like: latent THW, audio
    jobs = []
    for run in range(10):
        thw, audio = sizes[run % 2]
        jobs.append({"seed": (run // 2) % 2, "lora": (None, 3, 4)[run % 3],
                     "inputs": make_inputs(CONFIG, latent_thw=thw, audio_t=audio, seed=run)})
    references = []
    for job in jobs:  # a fresh load of the job's model, unpatched
        fresh = make_tiny_h3(CONFIG, seed=job["seed"])
        if job["lora"] is not None:
            fresh = with_lora(fresh, make_lora_state_dict(fresh, seed=job["lora"]))
        references.append(run_like_sampler(fresh, job["inputs"], sigmas=SIGMAS))
        del fresh
        unload_all()
    models = {seed: with_pack(make_tiny_h3(CONFIG, seed=seed)) for seed in (0, 1)}
    loras = {seed: {s: make_lora_state_dict(models[seed], seed=s) for s in (3, 4)}
             for seed in models}
    process = psutil.Process()
    tracemalloc.start()
    rows = []
    try:
        for job, reference in zip(jobs, references, strict=True):
            model = models[job["seed"]]
            if job["lora"] is not None:
                model = with_lora(model, loras[job["seed"]][job["lora"]])
            out = run_like_sampler(model, job["inputs"], sigmas=SIGMAS)
            assert same(out, reference), f"run {len(rows) + 1} differs from a fresh load"
            del model, out
            gc.collect()
            held = pack_memory()
            rows.append({"rss": process.memory_info().rss,
                         "traced": tracemalloc.get_traced_memory()[0],
                         "host_buffers": held.host_buffers, "host_bytes": held.host_bytes,
                         "workspaces": held.workspaces, "threads": held.threads})
    finally:
        tracemalloc.stop()
    mib = 1 << 20
    print("\nrun  RSS MiB  traced KiB  host buffers  host KiB  workspaces  threads")
    for i, r in enumerate(rows, 1):
        print(f"{i:>3}  {r['rss'] / mib:7.1f}  {r['traced'] / 1024:10.1f}  "
              f"{r['host_buffers']:12}  {r['host_bytes'] / 1024:8.1f}  {r['workspaces']:10}  "
              f"{len(r['threads'])}")
    # the pack's live objects never grow past what the first four runs held: each model's host
    # copies, plus the staging ring (2 buffers, 1 thread) of the model loaded last
    for key in ("host_buffers", "host_bytes", "workspaces"):
        assert max(r[key] for r in rows[4:]) <= max(r[key] for r in rows[:4]), \
            (key, [r[key] for r in rows])
    assert all(len(r["threads"]) <= 1 for r in rows), [r["threads"] for r in rows]
    assert all(r["workspaces"] == 0 for r in rows)  # ComfyUI's cleanup after every run
    # flat: the highest value of runs 7-10 at most the highest of runs 3-6 plus a tolerance of
    # 32 MiB of RSS (the allocator's caching moves single readings by ~40 MiB either way on a
    # ~900 MiB process) and 256 KiB of Python objects (tracemalloc)
    for key, tolerance in (("rss", 32 * mib), ("traced", 256 * 1024)):
        values = [r[key] for r in rows]
        assert max(values[6:]) - max(values[2:6]) < tolerance, (key, values)
