"""Dual-Sage on ComfyUI's real H3 model through the real ModelPatcher and sampler path.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_dual_sage_comfyui.py

CPU: helper "devices" are the CPU (streams are no-ops), ComfyUI's default attention is its
sub-quadratic kernel, two threads (where a head subset needs 2 heads to keep the whole call's
bits: `common/exactness.py`). Models: fp32 and INT8 ConvRot (the official DiT format, bf16
config) tiny checkpoints loaded by ComfyUI's loader. `multi_gpu`: root cuda:1, helper cuda:0,
bf16, 56 heads of 128, ComfyUI's SDPA with its backend priority. Every case compares with
ComfyUI's own unpatched output and counts that the feature ran (split calls, the functions
called per head subset). On ComfyUI 0.33.0 (no per-module ComfyAttention) the preferred-attention
case skips with the reason and the startup flags' kernel case covers what that release runs.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from comfyui_h3 import (
    AttentionCounter,
    TinyH3Config,
    import_comfyui_or_skip,
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    preferred_attention_missing,
    run_like_sampler,
    set_preferred_attention,
    unload_all,
    with_lora,
)

from h3_multigpu import chunking, offload
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.common import floors as common_floors
from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.kernels import AttentionBackend, Constraints, mark_unavailable
from h3_multigpu.kernels import register as register_backend

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]

CONFIG = TinyH3Config(heads=8, adaln="curve")  # 8 heads of 128: split 3:3:2 over 3 devices
INT8 = TinyH3Config(heads=8, adaln="curve", weights="int8_convrot", dtype=torch.bfloat16)
MODELS = {"fp32": CONFIG, "int8_convrot": INT8}
HELPERS = ("cpu", "cpu")
SUBSETS = 3  # attention calls per split call: the root's heads and one chunk per helper


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def dual(patcher, **options):
    options.setdefault("min_tokens", 0)
    return apply_dual_sage(patcher, DualSageConfig(helpers=options.pop("helpers", HELPERS),
                                                   **options))


def shard_of(patcher):
    """Dual-Sage's sharded attention, wherever its override sits in the chain."""
    override = patcher.model_options["transformer_options"]["optimized_attention_override"]
    while not hasattr(override, "sharded"):
        override = override.previous  # another feature's override chained around it
    return override.sharded


@pytest.mark.parametrize("weights", MODELS)
def test_equals_unpatched_with_comfyuis_default_attention(weights):
    patcher = make_tiny_h3(MODELS[weights], seed=0)
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    with AttentionCounter() as plain_calls:
        plain = run_like_sampler(patcher, inputs)
    patched = dual(patcher)
    with AttentionCounter() as calls:
        out = run_like_sampler(patched, inputs, sigmas=(0.9, 0.0))
    assert same(out, plain)
    shard = shard_of(patched)
    assert shard.routes["split"] == CONFIG.blocks  # every DiT attention call was split ...
    # ... and ran ComfyUI's own default kernel once per head subset (the refiner runs whole
    # in extra_conds, where no override reaches)
    assert plain_calls.default == CONFIG.refiner_blocks + CONFIG.blocks
    assert calls.entered == plain_calls.entered
    assert calls.default == CONFIG.refiner_blocks + CONFIG.blocks * SUBSETS
    assert shard.workspace_allocations >= 1
    assert shard.workspace_bytes() == 0  # ComfyUI's cleanup after sampling freed them
    status = protocol.status_lines(patched)["dual_sage"]
    assert "exact: yes" in status and "subsets of >= 2 heads" in status, status


def test_the_startup_flags_kernel_is_what_gets_sharded():
    """What every release runs when nothing prefers another function (0.33.0 always): the
    kernel ComfyUI's flags made `optimized_attention` (negated basic attention here, whose
    output differs from the CPU default on any CPU), sharded per head subset, equal to that
    kernel unpatched."""
    from comfyui_h3 import negated_basic_attention

    import_comfyui_or_skip()
    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    flagged = negated_basic_attention()
    default = run_like_sampler(patcher, inputs)
    with AttentionCounter(kernel=flagged) as plain_calls:
        plain = run_like_sampler(patcher, inputs)
    patched = dual(patcher)
    with AttentionCounter(kernel=flagged) as calls:
        out = run_like_sampler(patched, inputs)
    assert not same(plain, default) and same(out, plain)
    assert plain_calls.default == CONFIG.refiner_blocks + CONFIG.blocks
    assert calls.default == CONFIG.refiner_blocks + CONFIG.blocks * SUBSETS
    assert shard_of(patched).routes["split"] == CONFIG.blocks


def test_the_checkpoints_preferred_attention_is_what_gets_sharded():
    from comfyui_h3 import negated_basic_attention

    import_comfyui_or_skip()
    patcher = make_tiny_h3(CONFIG, seed=0)
    missing = preferred_attention_missing(patcher)
    if missing:
        pytest.skip(missing)
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    basic = negated_basic_attention()  # its output differs from the default's on any CPU
    default = run_like_sampler(patcher, inputs)
    with AttentionCounter() as plain_calls:
        set_preferred_attention(patcher, plain_calls.count_preferred(basic))
        try:
            plain = run_like_sampler(patcher, inputs)
            patched = dual(patcher)
            with AttentionCounter() as calls:
                set_preferred_attention(patcher, calls.count_preferred(basic))
                out = run_like_sampler(patched, inputs)
        finally:
            set_preferred_attention(patcher, None)
    assert not same(plain, default)  # the preferred function changes the output ...
    assert same(out, plain)  # ... and Dual-Sage gives exactly what it gives unpatched
    per_forward = CONFIG.refiner_blocks + CONFIG.blocks
    assert plain_calls.preferred == per_forward and plain_calls.default == 0
    # under Dual-Sage every call still runs the preferred function (once per head subset)
    assert calls.preferred == CONFIG.refiner_blocks + CONFIG.blocks * SUBSETS
    assert calls.default == 0 and shard_of(patched).routes["split"] == CONFIG.blocks


@pytest.mark.parametrize("weights", MODELS)
def test_lora_on_off_on_and_lowvram_lora_equal_unpatched(weights):
    patcher = make_tiny_h3(MODELS[weights], seed=0)
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    lora_sd = make_lora_state_dict(patcher, rank=4, seed=3)
    lora = with_lora(patcher, lora_sd)
    base, on = run_like_sampler(patcher, inputs), run_like_sampler(lora, inputs)
    patched = dual(patcher)
    patched_lora = with_lora(patched, lora_sd)  # LoraLoader after the Dual-Sage node
    lora_patched = dual(lora)  # ... and before it
    runs = [run_like_sampler(m, inputs) for m in (patched, patched_lora, patched, lora_patched,
                                                   patched_lora, patched)]
    assert not same(base, on)
    assert same(runs[0], base) and same(runs[2], base) and same(runs[5], base)
    assert same(runs[1], on) and same(runs[3], on) and same(runs[4], on)
    # lowvram runs last: ComfyUI 0.33.0 cannot load an INT8 model fully again after a lowvram
    # load in inference mode ("Cannot set version_counter for inference tensor", raised in
    # comfy.ops._quantized_apply, unpatched too)
    lowvram_on = run_like_sampler(lora, inputs, lowvram_bytes=1)
    low = run_like_sampler(patched_lora, inputs, lowvram_bytes=1)
    assert lowvram_patched_modules(patched_lora) > 0 and same(low, lowvram_on)
    # the LoRA clone shares the Dual-Sage runtime: every run split its calls
    assert shard_of(patched_lora) is shard_of(patched)
    assert shard_of(patched).routes["split"] == 6 * CONFIG.blocks
    assert shard_of(lora_patched).routes["split"] == CONFIG.blocks


def test_helper_failure_is_remembered_for_the_run_and_retried_next_run(monkeypatch, caplog):
    sharded_module._warned.clear()
    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG)
    sigmas = (0.9, 0.6, 0.0)  # two model calls in one sampling run
    plain = run_like_sampler(patcher, inputs, sigmas=sigmas)
    patched = dual(patcher)
    shard = shard_of(patched)
    attempts = []

    def failing(self, attend, slot):
        attempts.append(slot.shape)
        raise torch.OutOfMemoryError("simulated: helper out of memory")

    monkeypatch.setattr(type(shard), "_helper_attention", failing)
    with caplog.at_level(logging.WARNING, logger=sharded_module.__name__):
        out = run_like_sampler(patched, inputs, sigmas=sigmas)
        again = run_like_sampler(patched, inputs, sigmas=sigmas)
    assert same(out, plain) and same(again, plain)
    # one attempt per run (the cleanup after a run forgets the failure: the next run retries)
    assert len(attempts) == 2 and shard.routes["fallback"] == 2 * 2 * CONFIG.blocks
    assert len([r for r in caplog.records if "helper failed" in r.getMessage()]) == 1
    monkeypatch.undo()
    assert same(run_like_sampler(patched, inputs, sigmas=sigmas), plain)
    assert shard.last_route == "split"


def test_unloading_the_model_frees_the_workspaces():
    patcher = make_tiny_h3(CONFIG, seed=0)
    patched = dual(patcher)
    shard = shard_of(patched)
    released = []
    original = shard.release
    shard.release = lambda: released.append("release") or original()
    run_like_sampler(patched, make_inputs(CONFIG))
    assert released == ["release"]  # ComfyUI's cleanup after the sampling run
    unload_all()
    assert released == ["release", "release"]  # ComfyUI's detach when the model is unloaded
    assert shard.workspace_bytes() == 0


@pytest.fixture
def counting_backend():
    calls = []

    def run(q, k, v, *, scale=None):
        calls.append(q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    register_backend(AttentionBackend(
        name="test_counting", fn=run, deterministic=True, description="test",
        constraints=Constraints(dtypes=frozenset({torch.float32}),
                                device_types=frozenset({"cpu"}))))
    yield calls
    mark_unavailable("test_counting", "test finished")


@pytest.mark.parametrize("order", ["sage_first", "dual_sage_first"])
def test_sage_node_and_dual_sage_compose_on_comfyui(order, counting_backend):
    from h3_multigpu.nodes.attention_override import apply_backend_override

    patcher = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, keyframe=True)
    single = run_like_sampler(apply_backend_override(patcher, "test_counting"), inputs)
    counting_backend.clear()
    if order == "sage_first":
        patched = dual(apply_backend_override(patcher, "test_counting"))
        shard = shard_of(patched)
    else:
        with_dual = dual(patcher)
        shard = shard_of(with_dual)
        patched = apply_backend_override(with_dual, "test_counting")
    out = run_like_sampler(patched, inputs)
    assert same(out, single)  # the Sage kernel on one GPU, bit for bit
    assert counting_backend == [3, 3, 2] * CONFIG.blocks and shard.routes["split"] == CONFIG.blocks
    lines = protocol.status_lines(patched)
    assert "test_counting" in lines["dual_sage"] and "test_counting" in lines["attention"]


def test_uneven_head_groups_of_chunking_share_one_workspace(monkeypatch):
    # the GPU's split-KV rule (enough query tiles per call) scaled to this ~50-row sequence
    monkeypatch.setattr(common_floors, "MIN_QUERY_TILES_PER_CALL", 1)
    config = TinyH3Config(heads=13, adaln="full")
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, audio_mask=True)
    chunk_config = chunking.ChunkingConfig(head_group=5, qkv_chunk=32, ffn_chunk=32)  # 5+4+4
    chunked = chunking.apply_activation_chunking(patcher, chunk_config)
    plain = run_like_sampler(chunked, inputs)
    for patched in (dual(chunked, helpers=("cpu",), split="0.4:0.6"),
                    chunking.apply_activation_chunking(
                        dual(patcher, helpers=("cpu",), split="0.4:0.6"), chunk_config)):
        assert same(run_like_sampler(patched, inputs), plain)
        shard = shard_of(patched)
        # head groups of 5, 4 and 4 heads per block split 0.4:0.6 into 2:3, 2:2 and 2:2 (>= 2
        # heads a subset, as two threads need): the helper's share changes, and one allocation
        # serves every block
        assert [shard.plan.counts_for(h) for h in (5, 4)] == [(2, 3), (2, 2)]
        assert shard.routes["split"] == 3 * config.blocks and shard.workspace_allocations == 1


# ---------------------------------------------------------------------- two real GPUs
ROOT, HELPER = torch.device("cuda", 1), torch.device("cuda", 0)
H3_GPU = TinyH3Config(hidden=1024, heads=56, head_dim=128, ffn=1024, blocks=2, refiner_blocks=1,
                      adaln="curve", dtype=torch.bfloat16)
# (latent T, H, W, audio T) -> packed tokens: 16 text + 2 x audio T + T x (H/2) x (W/2)
#   (+ one frame of keyframe rows)
LENGTHS = {3_320: ((10, 32, 40), 52, False), 16_008: ((30, 32, 64), 60, True)}


@pytest.fixture(scope="module")
def h3_on_two_gpus():
    import_comfyui_or_skip()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return make_tiny_h3(H3_GPU, seed=0, load_device=ROOT)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("tokens", sorted(LENGTHS))
@pytest.mark.parametrize("min_tokens", [None, 0], ids=["default", "forced"])
def test_two_gpus_bf16_equal_unpatched(h3_on_two_gpus, tokens, min_tokens):
    patcher = h3_on_two_gpus
    thw, audio_t, keyframe = LENGTHS[tokens]
    inputs = make_inputs(H3_GPU, latent_thw=thw, audio_t=audio_t, keyframe=keyframe,
                         audio_mask=keyframe)
    with torch.cuda.device(ROOT):  # ComfyUI's own run needs its device current (comfy-kitchen)
        plain = run_like_sampler(patcher, inputs)
    lora_sd = make_lora_state_dict(patcher, rank=8, seed=3)
    with torch.cuda.device(ROOT):
        plain_lora = run_like_sampler(with_lora(patcher, lora_sd), inputs)
    patched = apply_dual_sage(patcher, DualSageConfig(helpers=(str(HELPER),),
                                                      min_tokens=min_tokens))
    shard = shard_of(patched)
    # the token refiner runs in extra_conds, outside the DiT forward Dual-Sage makes current:
    # the caller (the placement's device guard) makes the root current around sampling
    with torch.cuda.device(ROOT), AttentionCounter() as calls:
        out = run_like_sampler(patched, inputs)
        out_lora = run_like_sampler(with_lora(patched, lora_sd), inputs)
    assert same(out, plain) and same(out_lora, plain_lora)
    expect_split = min_tokens == 0 or tokens >= shard.min_tokens
    assert shard.routes["split"] == (2 * H3_GPU.blocks if expect_split else 0)
    assert calls.entered == 2 * (H3_GPU.refiner_blocks + H3_GPU.blocks)  # two runs
    unload_all()
    assert shard.workspace_bytes() == 0


@pytest.mark.parametrize("with_prefetch", [False, True], ids=["chunking", "chunking+prefetch"])
def test_composed_with_chunking_and_prefetch_in_any_order(with_prefetch):
    import itertools

    features = {
        "dual_sage": dual,
        # rows of >= 16 per chunk (two threads: fp32 slices of <= 11 rows differ)
        "chunking": lambda p: chunking.apply_activation_chunking(
            p, chunking.ChunkingConfig(ffn_chunk=24, qkv_chunk=24)),
    }
    if with_prefetch:
        features["prefetch"] = lambda p: offload.apply_block_prefetch(
            p, offload.PrefetchConfig(resident_blocks=1, lookahead=1))
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    for order in itertools.permutations(features):
        unload_all()
        patcher = make_tiny_h3(CONFIG, seed=0)  # a fresh model: the prefetcher moves weights
        lora_sd = make_lora_state_dict(patcher, rank=4, seed=3)
        base = run_like_sampler(patcher, inputs)
        on = run_like_sampler(with_lora(patcher, lora_sd), inputs)
        patched = patcher
        for name in order:
            patched = features[name](patched)
        patched_lora = with_lora(patched, lora_sd)
        runs = [run_like_sampler(m, inputs) for m in (patched, patched_lora, patched,
                                                       patched_lora)]
        assert same(runs[0], base) and same(runs[2], base), order
        assert same(runs[1], on) and same(runs[3], on), order
        # per block and run: the 8-head call split 3:3:2 over the devices; four runs
        assert shard_of(patched).routes == {"split": 4 * CONFIG.blocks}, order


@pytest.mark.multi_gpu
def test_two_gpus_shard_the_checkpoints_comfy_kitchen_int8(h3_on_two_gpus):
    """A checkpoint whose comfy_attention.config selects comfy-kitchen int8: unpatched ComfyUI
    runs its container path (prequantize from the containers), Dual-Sage its tensor path on
    each head subset; int8 quantizes per head, so both must give the same bits."""
    comfy = import_comfyui_or_skip()
    attention = comfy.ldm.modules.attention
    if not getattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
        pytest.skip("comfy-kitchen int8 attention is not available here")
    patcher = h3_on_two_gpus
    thw, audio_t, keyframe = LENGTHS[16_008]
    inputs = make_inputs(H3_GPU, latent_thw=thw, audio_t=audio_t, keyframe=keyframe)
    patched = apply_dual_sage(patcher, DualSageConfig(helpers=(str(HELPER),)))
    with AttentionCounter() as calls:
        set_preferred_attention(patcher, calls.count_preferred(
            attention.attention_comfy_kitchen_int8))
        try:
            with torch.cuda.device(ROOT):
                plain = run_like_sampler(patcher, inputs)
                out = run_like_sampler(patched, inputs)
        finally:
            set_preferred_attention(patcher, None)
    assert shard_of(patched).routes["split"] == H3_GPU.blocks and calls.default == 0
    assert same(out, plain)
