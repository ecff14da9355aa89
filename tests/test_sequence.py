"""Sequence-parallel mode on CPU: several fake "devices" all mapped to the CPU.

Streams and events are no-ops on the CPU and every copy is synchronous, so these tests check the
data flow (rows, heads, chunks, segments, RoPE rows, the exchange in both transports, weights on
helpers) bit for bit against the plain single-device forward. They run with two threads, as
ComfyUI does on a CPU: CPU BLAS then takes other paths for a few rows (fp32 slices of up to 11
rows differed, measured), so every row share and chunk here keeps >= 16 rows, and a 1-head
attention call differs from the whole call, so every device attends >= 2 heads per call
(`common/exact_range.json` "cpu"; the split raises its chunks to that and refuses fewer).
The exactness claim on GPUs is the `multi_gpu` tests' job.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin
from twin import model as twin_model

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.exchange.mode import PARALLEL_KEY
from h3_multigpu.sequence import (
    SequenceParallelConfig,
    SequenceRunner,
    SequenceSplit,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence import runner as runner_module
from h3_multigpu.sequence.plan import block_args, positional
from h3_multigpu.sequence.weights import REPLICA, STREAM, HelperWeights

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def on_cpu(patcher, devices=2, **kwargs):
    kwargs.setdefault("parallel", "sequence")
    config = SequenceParallelConfig(helpers=("cpu",) * (devices - 1), **kwargs)
    return apply_sequence_parallel(patcher, config)


class Counter:
    """Wraps a method of a class and counts (and optionally records) its calls."""

    def __init__(self, monkeypatch, owner, name, record=None):
        self.calls = []
        original = getattr(owner, name)

        def spy(*args, **kwargs):
            self.calls.append(record(*args, **kwargs) if record else None)
            return original(*args, **kwargs)

        is_static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        monkeypatch.setattr(owner, name, staticmethod(spy) if is_static else spy)


# ---------------------------------------------------------------------- the twin, end to end
# every share keeps >= 16 rows: CPU BLAS takes other paths for a handful of rows
CASES = [  # devices, split, chunk heads, transport, twin heads, latent (t, h, w), audio_t
    (2, "auto", 1, "peer", 8, (3, 4, 6), 5),
    (2, "1:3", 2, "host", 8, (3, 6, 10), 5),  # odd S = 71
    (2, "3:1", 3, "peer", 8, (3, 6, 10), 5),
    (3, "3:2:2", 1, "host", 8, (3, 6, 10), 4),
    (4, "auto", 1, "peer", 8, (5, 8, 10), 5),
    (7, "auto", 1, "host", 14, (5, 8, 10), 5),
    (7, "2:3:2:2:4:2:2", 2, "peer", 16, (7, 8, 10), 5),  # heads 2:3:2:2:3:2:2
]


@pytest.mark.parametrize("devices,split,chunk_heads,transport,heads,latent,audio_t", CASES)
def test_twin_output_is_bit_identical(monkeypatch, devices, split, chunk_heads, transport,
                                      heads, latent, audio_t):
    cfg = TwinConfig.tiny(heads=heads)
    model = make_twin(cfg, seed=0)
    t, h, w = latent
    inputs = make_inputs(cfg, latent_t=t, latent_h=h, latent_w=w, audio_t=audio_t, seed=1)
    reference = TwinPatcher(model).apply_model(*inputs)
    seq_len = 16 + 2 * audio_t + t * (h // 2) * (w // 2)

    attended = Counter(monkeypatch, runner_module.ShareAttention, "_attend",
                       lambda self, func, q, k, v, g, kw: (q.shape[2], g))
    forwards = Counter(monkeypatch, twin_model.DiTBlock, "forward",
                       lambda block, x, *a, **kw: (id(block), x.shape[0]))
    scatters = Counter(monkeypatch, SequenceRunner, "scatter")
    gathers = Counter(monkeypatch, SequenceRunner, "gather")
    patched = on_cpu(TwinPatcher(model), devices, split=split, chunk_heads=chunk_heads,
                     transport=transport)
    for _ in range(2):  # links, relay slots and helper weights are reused by the second step
        assert same(patched.apply_model(*inputs), reference)
    mode = get_sequence_parallel(patched)
    # every block ran split; each device attended its heads over all rows, chunk by chunk
    assert mode.steps["sequence"] == 2 and mode.blocks_run == 2 * cfg.blocks
    chunks = [mode.split.chunks_of(j, seq_len) for j in range(devices)]
    per_block = sorted((seq_len, h1 - h0) for cs in chunks for h0, h1 in cs)
    assert sorted(attended.calls) == sorted(per_block * 2 * cfg.blocks)
    assert sum(g for _, g in per_block) == heads
    # upstream's block forward ran once per share per block, on that share's rows, each
    # helper on a module of its own (never the root's)
    shares = [b - a for a, b in mode.split.rows_for(seq_len)]
    assert sorted(rows for _, rows in forwards.calls) == sorted(shares * 2 * cfg.blocks)
    root_blocks = {id(b) for b in model.blocks}
    assert sum(block in root_blocks for block, _ in forwards.calls) == 2 * cfg.blocks
    # the residual stream stayed split across the block loop: one scatter, one gather per step
    assert len(scatters.calls) == 2 and len(gathers.calls) == 2
    links = mode.runner.links
    assert len(links) == devices * (devices - 1) and all(link.copies for link in links.values())
    assert {link.mode.value for link in links.values()} == {transport}


def test_a_one_head_share_runs_single_threaded_only():
    """With two threads a 1-head attention call can differ from the whole call on the CPU
    (measured): a split that leaves a device one head is refused, the step runs on one device
    and the status says why; single-threaded it runs split, bit-identical."""
    cfg = TwinConfig.tiny(heads=2)
    model = make_twin(cfg, seed=0)
    inputs = make_inputs(cfg, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = on_cpu(TwinPatcher(model))
    assert same(patched.apply_model(*inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps == {"sequence": 0, "heads": 0, "off": 1, "fallback": 0}
    status = protocol.status_lines(patched)["sequence"]
    assert "a device attends 1 head(s)" in status and "needs >= 2 heads" in status
    torch.set_num_threads(1)
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = on_cpu(TwinPatcher(model))
    assert same(patched.apply_model(*inputs), reference)
    assert get_sequence_parallel(patched).steps["sequence"] == 1


@torch.no_grad()
def test_per_token_modulation_rows_and_segments_are_remapped():
    """A block with per-token mod-row tensors (upstream's masked rows) and many segments."""
    from twin.rope import rope_rotation_table

    cfg = TwinConfig.tiny()
    block = twin_model.DiTBlock(cfg).requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    seq_len = 97
    x = torch.randn(seq_len, cfg.hidden, generator=gen)
    t_emb = torch.randn(4, cfg.t_dim, generator=gen)  # 4 timesteps x 3 tags = 12 mod rows
    rows = torch.randint(0, 12, (57,), generator=gen)
    segments = [(0, 7, 1), (7, 9, 4), (9, 40, 2), (40, 97, rows)]
    rope = rope_rotation_table(torch.randn(seq_len, 6 * cfg.rope_freqs_per_axis, generator=gen),
                               torch.float32)
    reference = block(x.clone(), t_emb, segments, rope)
    assert not torch.equal(reference, x)

    for weights, chunk in (((1.0, 1.0), 1), ((1.0, 0.5), 2), ((2.0, 1.0, 1.0), 1)):
        split = SequenceSplit.weighted((CPU,) * len(weights), cfg.heads, weights,
                                       chunk_heads=chunk)
        runner = SequenceRunner(split, runner_module.TransportMode.PEER)
        helpers = [_replica(block) for _ in range(1, len(weights))]
        h = x.clone()
        state = runner.scatter(block_args(h, t_emb, segments, rope))
        # the per-token rows were cut at every share boundary and each share re-based to 0
        for share in state.shares:
            assert share.segments[0][0] == 0 and share.segments[-1][1] == share.rows
        cut = [seg[2] for share in state.shares for seg in share.segments
               if isinstance(seg[2], torch.Tensor)]
        assert sum(len(t) for t in cut) == 57 and len(cut) == len(weights)
        runner.run_block(state, block_calls(block, helpers), {}, [block] * len(weights))
        runner.gather(state)
        runner.close()
        assert torch.equal(h, reference)


def _replica(block):
    weights = HelperWeights(CPU, [block], REPLICA)
    weights.refresh(None, None)
    return weights


def block_calls(block, helpers):
    """Share calls for `SequenceRunner.run_block`: the root's block, then each helper's copy."""
    def root(args, options):
        return block(*positional(args), transformer_options=options)

    def helper(weights):
        def call(args, options):
            with weights.use(0) as module:
                return module(*positional(args), transformer_options=options)
        return call

    return [root] + [helper(w) for w in helpers]


# ---------------------------------------------------------------------- mode choice, fallback
def test_short_sequences_are_refused_and_run_on_one_gpu(tiny_twin, tiny_inputs):
    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    patched = on_cpu(TwinPatcher(tiny_twin), min_rows=30)  # 44 tokens -> 22-row shares
    assert same(patched.apply_model(*tiny_inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps == {"sequence": 0, "heads": 0, "off": 1, "fallback": 0}
    assert "22 rows" in mode.decisions[44].reason and mode.runner is None
    status = protocol.status_lines(patched)["sequence"]
    assert "sequence parallel sequence" in status and ">= 30" in status


def test_auto_picks_one_gpu_when_splitting_is_predicted_slower(tiny_twin, tiny_inputs):
    patched = on_cpu(TwinPatcher(tiny_twin), parallel="auto")
    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    assert same(patched.apply_model(*tiny_inputs), reference)
    decision = get_sequence_parallel(patched).decisions[44]
    # 44 tokens: the host time to queue a split block dwarfs the work
    assert decision.mode.value == "off" and decision.predicted_ms["sequence"] > \
        decision.predicted_ms["off"]


def test_helper_failure_runs_the_step_on_one_gpu_and_warns_once(monkeypatch, tiny_twin,
                                                                 tiny_inputs, caplog):
    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    patched = on_cpu(TwinPatcher(tiny_twin))
    original = runner_module.ShareAttention._attend
    failures = []

    def failing(self, func, q, k, v, g, kwargs):
        if not failures and self.k == 1:
            failures.append(1)
            raise torch.OutOfMemoryError("helper out of memory (simulated)")
        return original(self, func, q, k, v, g, kwargs)

    monkeypatch.setattr(runner_module.ShareAttention, "_attend", failing)
    caplog.set_level(logging.WARNING)
    assert same(patched.apply_model(*tiny_inputs), reference)
    assert same(patched.apply_model(*tiny_inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps["fallback"] == 1 and mode.steps["sequence"] == 1
    assert mode.steps["off"] == 2  # the failed step re-ran on one GPU, and so did the next
    warnings = [r for r in caplog.records if "helper failed" in r.getMessage()]
    assert len(warnings) == 1 and "44" in warnings[0].getMessage()


def test_dual_sage_stands_aside_under_sequence_and_runs_under_heads(tiny_twin, tiny_inputs):
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage

    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    for parallel, expected in (("sequence", [16]), ("heads", [16, 44, 44, 44])):
        dual = apply_dual_sage(TwinPatcher(tiny_twin),
                               DualSageConfig(helpers=("cpu",), min_tokens=0))
        patched = on_cpu(dual, parallel=parallel)
        shard = dual.model_options["transformer_options"]["optimized_attention_override"].sharded
        lengths = []
        original = shard._split
        shard._split = lambda *a, o=original, acc=lengths: acc.append(a[1].shape[2]) or o(*a)
        assert same(patched.apply_model(*tiny_inputs), reference)
        # the refiner's call (16 text tokens) comes before the block loop decides
        assert lengths == expected
        mode = get_sequence_parallel(patched)
        assert mode.steps[parallel] == 1


def test_the_mode_flag_lives_only_during_the_forward(tiny_twin, tiny_inputs):
    seen = []

    def spy(func, q, k, v, heads, **kwargs):
        seen.append(kwargs["transformer_options"].get(PARALLEL_KEY))
        return func(q, k, v, heads, **kwargs)

    base = TwinPatcher(tiny_twin).clone()
    base.set_model_optimized_attention(spy)
    patched = on_cpu(base, chunk_heads=4)
    patched.apply_model(*tiny_inputs)
    # the refiner's call comes before the first block decides; then 2 chunks x 3 blocks
    assert seen == [None] + ["sequence"] * 6
    assert PARALLEL_KEY not in patched.model_options["transformer_options"]


# ---------------------------------------------------------------------- composition
def test_foreign_patches_see_the_whole_residual_stream():
    """Patches that read img: one replacing ours without chaining (block 0), one chained inside
    ours (block 2, after two split blocks), one chaining ours from outside (block 4)."""
    cfg = TwinConfig.tiny(blocks=5)
    model = make_twin(cfg, seed=0)
    inputs = make_inputs(cfg, latent_t=3, latent_h=4, latent_w=6, audio_t=5, seed=1)

    def reader(log, previous=None):
        def patch(args, extra):
            log.append(args["img"].clone())
            if previous is not None:
                return previous(args, extra)
            return extra["original_block"](args)
        return patch

    def install(patcher, log, blocks, chain):
        for i in blocks:
            previous = patcher.model_options["transformer_options"].get(
                "patches_replace", {}).get("dit", {}).get(("double_block", i)) if chain else None
            patcher.set_model_patch_replace(reader(log, previous), "dit", "double_block", i)

    plain_log, split_log = [], []
    plain = TwinPatcher(model).clone()
    install(plain, plain_log, (0, 2, 4), chain=True)
    reference = plain.apply_model(*inputs)

    inner = TwinPatcher(model).clone()
    install(inner, split_log, (2,), chain=True)
    patched = on_cpu(inner)
    install(patched, split_log, (0,), chain=False)
    install(patched, split_log, (4,), chain=True)
    assert same(patched.apply_model(*inputs), reference)
    assert len(split_log) == 3
    assert all(torch.equal(a, b) for a, b in zip(split_log, plain_log, strict=True))
    mode = get_sequence_parallel(patched)
    assert mode.blocks_run == 4  # block 0 was replaced; 1-4 still ran split
    assert mode.forward is None


def test_activation_chunking_applies_per_share(monkeypatch, tiny_config, tiny_twin):
    from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking

    # S = 16 + 10 + 3*4*5 = 86: shares of 43 rows, chunks of 24 -> 22 + 21 (>= 16 rows each)
    inputs = make_inputs(tiny_config, latent_t=3, latent_h=8, latent_w=10, audio_t=5, seed=1)
    config = ChunkingConfig(ffn_chunk=24, qkv_chunk=24)
    reference = TwinPatcher(tiny_twin).apply_model(*inputs)
    rows = []
    hooks = [block.mlp.fc1.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
             for block in tiny_twin.blocks]
    try:
        for patched in (on_cpu(apply_activation_chunking(TwinPatcher(tiny_twin), config)),
                        apply_activation_chunking(on_cpu(TwinPatcher(tiny_twin)), config)):
            assert same(patched.apply_model(*inputs), reference)
            assert get_sequence_parallel(patched).steps["sequence"] == 1
    finally:
        for hook in hooks:
            hook.remove()
    # the MLP ran in row chunks inside each 43-row share (root and helper copy), both orders
    blocks = len(tiny_twin.blocks)
    assert len(rows) == 2 * 2 * 2 * blocks and max(rows) <= 24, rows


@pytest.mark.parametrize("helper_weights", [REPLICA, STREAM])
@pytest.mark.parametrize("order", ["prefetch first", "sequence first"])
def test_composes_with_the_prefetcher_and_streams_from_its_arena(monkeypatch, tiny_twin,
                                                                 tiny_inputs, helper_weights,
                                                                 order):
    from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch

    scatters = Counter(monkeypatch, SequenceRunner, "scatter")
    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    prefetch = PrefetchConfig(resident_blocks=0, lookahead=1)
    if order == "prefetch first":
        patched = on_cpu(apply_block_prefetch(TwinPatcher(tiny_twin), prefetch),
                         helper_weights=helper_weights, lookahead=1)
    else:
        patched = apply_block_prefetch(on_cpu(TwinPatcher(tiny_twin),
                                              helper_weights=helper_weights, lookahead=1),
                                       prefetch)
    for _ in range(2):
        assert same(patched.apply_model(*tiny_inputs), reference)
    mode = get_sequence_parallel(patched)
    weights = mode.helper_weights[1]
    assert weights.mode == helper_weights and mode.blocks_run == 6
    if helper_weights == STREAM:
        # both devices read the prefetcher's host copies: no host copy of our own was made
        assert weights.own_host == {} and weights.copies >= 3
        assert len(weights.slots) == 2
    assert mode.steps["sequence"] == 2
    # the prefetcher's patch only brackets the block: the rows stayed split across it
    assert len(scatters.calls) == 2


@pytest.mark.parametrize("helper_weights", [REPLICA, STREAM])
def test_weight_changes_reach_the_helper(tiny_twin, tiny_inputs, helper_weights):
    """ComfyUI re-patching a LoRA replaces parameters (or writes in place and stamps the model)."""
    patched = on_cpu(TwinPatcher(tiny_twin), helper_weights=helper_weights)
    patched.apply_model(*tiny_inputs)
    mode = get_sequence_parallel(patched)
    assert mode.helper_weights[1].refreshes == 1
    qkv = tiny_twin.blocks[1].attn.qkv_proj
    fc1 = tiny_twin.blocks[2].mlp.fc1
    old = (qkv.weight, fc1.weight.detach().clone())
    try:
        qkv.weight = torch.nn.Parameter(qkv.weight * 1.5, requires_grad=False)  # replaced
        with torch.no_grad():
            fc1.weight.data.mul_(0.5)  # in place, with the model's patch stamp moved
        patched.model.current_weight_patches_uuid = "lora-2"
        reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
        assert same(patched.apply_model(*tiny_inputs), reference)
        assert mode.helper_weights[1].refreshes == 2
        assert same(patched.apply_model(*tiny_inputs), reference)
        assert mode.helper_weights[1].refreshes == 2  # unchanged weights: no copy
    finally:
        qkv.weight = old[0]
        with torch.no_grad():
            fc1.weight.copy_(old[1])


def test_release_frees_the_helpers_and_the_next_step_rebuilds(tiny_twin, tiny_inputs):
    patched = on_cpu(TwinPatcher(tiny_twin))
    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    patched.apply_model(*tiny_inputs)
    mode = get_sequence_parallel(patched)
    weights = mode.helper_weights[1]
    assert weights.device_bytes == weights.total_bytes > 0
    mode.release()
    assert mode.helper_weights == {} and mode.runner is None and weights.device_bytes == 0
    assert same(patched.apply_model(*tiny_inputs), reference)
    assert mode.helper_weights[1].device_bytes == weights.total_bytes


def test_outer_sample_wrapper_releases_after_sampling(tiny_twin):
    patched = on_cpu(TwinPatcher(tiny_twin))
    mode = get_sequence_parallel(patched)
    released = []
    mode.release = lambda: released.append(1)
    wrappers = patched.model_options["transformer_options"]["wrappers"]["outer_sample"]
    (wrapper,) = wrappers["h3_multigpu.sequence"]
    assert wrapper(lambda *a: "sampled") == "sampled" and released == [1]


# ---------------------------------------------------------------------- validation
def test_bad_configs_are_refused_before_anything_runs(tiny_twin):
    with pytest.raises(ValueError, match="parallel 'sideways' is unknown"):
        SequenceParallelConfig(parallel="sideways")
    with pytest.raises(ValueError, match="helper_weights"):
        SequenceParallelConfig(helper_weights="disk")
    with pytest.raises(ValueError, match="transport"):
        SequenceParallelConfig(transport="carrier pigeon")
    with pytest.raises(ValueError, match="does not exist"):
        apply_sequence_parallel(TwinPatcher(tiny_twin, load_device="cpu"),
                                SequenceParallelConfig(helpers=("gpu:7",)))
    with pytest.raises(ValueError, match="3 entries for 2 devices"):
        on_cpu(TwinPatcher(tiny_twin), split="1:1:1")
    with pytest.raises(ValueError, match="not a list of numbers"):
        on_cpu(TwinPatcher(tiny_twin), split="fast:slow")


def test_split_rows_heads_and_chunks():
    gpus = tuple(torch.device("cuda", i) for i in range(2))
    default = SequenceSplit.even(gpus, 56)  # 7 heads per call: fastest measured on 2x H200
    assert default.chunks_of(1, 68706) == ((28, 35), (35, 42), (42, 49), (49, 56))
    split = SequenceSplit.even(gpus, 56, chunk_heads=4)
    assert split.head_counts == (28, 28) and split.chunks_of(1, 68706)[0] == (28, 32)
    assert len(split.chunks_of(0, 68706)) == 7
    assert split.rows_for(68706) == ((0, 34353), (34353, 68706))
    assert split.refusal(8191) is not None and split.refusal(8192) is None
    # short sequences: each call keeps >= 1024 (head, 64-row tile) work items (no split-KV)
    assert split.chunk_heads_for(15399) == 5 and split.chunk_heads_for(68706) == 4
    eight = SequenceSplit.even(tuple(torch.device("cuda", i) for i in range(8)), 56,
                               chunk_heads=4)
    assert eight.chunks_of(7, 102107) == ((49, 56),)  # 7 heads: one call, never 4 + 3
    four = SequenceSplit.even(tuple(torch.device("cuda", i) for i in range(4)), 56,
                              chunk_heads=4)
    assert four.chunks_of(0, 68706) == ((0, 5), (5, 10), (10, 14))
    weighted = SequenceSplit.weighted(gpus, 56, [1.0, 0.6])
    assert weighted.head_counts == (35, 21) and weighted.rows_for(1600) == ((0, 1000),
                                                                           (1000, 1600))
    with pytest.raises(ValueError, match="do not divide"):
        SequenceSplit.even(tuple(torch.device("cuda", i) for i in range(3)), 56)


# ---------------------------------------------------------------------- plan -> nodes -> config
def test_the_plan_reaches_the_config_and_the_node_lines():
    from h3_multigpu.nodes.features import check_options, plan_feature_strings
    from h3_multigpu.planner import PlanRequest, plan_job
    from h3_multigpu.sequence import config_from_plan

    plan = plan_job(PlanRequest(seconds=10, profile="2xH200"))
    wanted = plan_feature_strings(plan)["sequence"]
    assert wanted == {"parallel": "auto", "helpers": "gpu:0", "split": "1:1"}
    config = config_from_plan(plan, parallel=wanted["parallel"])
    assert config.helpers == ("cuda:0",) and config.transport.value == "peer"
    assert config.link_gbps == 393.0
    assert config.gpu_speeds[0].attention_tflops == plan.profile.gpus[1].attention_tflops
    assert config.note.startswith("plan: PASS1 sequence (1.9") and "PASS2 sequence" in config.note
    one = plan_job(PlanRequest(seconds=10, profile="1x5090"))
    assert plan_feature_strings(one)["sequence"].startswith("off: PASS1 off: one GPU")
    assert "parallel 'sometimes' is unknown" in check_options("sequence", parallel="sometimes")
    assert check_options("sequence", parallel="heads") is None


@pytest.mark.parametrize("helper_weights", [REPLICA, STREAM])
def test_buffers_made_under_inference_mode_serve_steps_outside_it(tiny_twin, tiny_inputs,
                                                                   helper_weights):
    """ComfyUI samples under inference mode. The relay slots, helper weights, the prefetcher's
    host arena, staging ring and slots made in that first step are refilled in place by later
    steps under either mode (and the staging worker thread starts outside inference mode)."""
    from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch

    reference = TwinPatcher(tiny_twin).apply_model(*tiny_inputs)
    block = sum(p.numel() * p.element_size() for p in tiny_twin.blocks[0].parameters())
    # a pinned budget below the streamed blocks: some stream through the staging ring
    prefetch = PrefetchConfig(resident_blocks=0, lookahead=1, pinned_budget_bytes=3 * block)
    patched = on_cpu(apply_block_prefetch(TwinPatcher(tiny_twin), prefetch),
                     helper_weights=helper_weights, lookahead=1, transport="host")
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            assert same(patched.apply_model(*tiny_inputs), reference)
    assert get_sequence_parallel(patched).steps["sequence"] == 3
    streamer = get_block_prefetch(patched).streamer
    assert streamer.staging is not None and streamer.staging.fills > 0


@pytest.mark.parametrize("transport", ["peer", "host"])
def test_four_devices_with_mixed_head_shares_are_bit_identical(transport):
    """H3's 56 heads as 20:12:12:12 over a root and three helpers (weights 5:3:3:3, as for one
    faster card): rows and heads follow the weights, the output is the one-device output."""
    cfg = TwinConfig.tiny(heads=56)
    model = make_twin(cfg, seed=0)
    inputs = make_inputs(cfg, latent_t=5, latent_h=8, latent_w=10, audio_t=5, seed=1)
    reference = TwinPatcher(model).apply_model(*inputs)
    patched = on_cpu(TwinPatcher(model), 4, split="5:3:3:3", transport=transport)
    assert same(patched.apply_model(*inputs), reference)
    mode = get_sequence_parallel(patched)
    assert mode.split.head_counts == (20, 12, 12, 12)
    rows = [b - a for a, b in mode.split.rows_for(126)]
    assert sum(rows) == 126 and rows[0] > max(rows[1:]) and min(rows) >= 16
    assert mode.steps["sequence"] == 1 and mode.blocks_run == cfg.blocks


@pytest.mark.parametrize("transport,chunk_heads,expected", [
    ("peer", None, 7), ("host", None, 4), ("host", 2, 2), ("peer", 3, 3)])
def test_heads_per_call_follow_the_transport_unless_set(tiny_twin, tiny_inputs, transport,
                                                        chunk_heads, expected):
    """Measured on 2x H200: 7 heads per call over peer copies, 4 through the relay."""
    options = {} if chunk_heads is None else {"chunk_heads": chunk_heads}
    patched = on_cpu(TwinPatcher(tiny_twin), transport=transport, **options)
    mode = get_sequence_parallel(patched)
    assert mode.split.chunk_heads == expected and mode.modes == {transport}
    assert same(patched.apply_model(*tiny_inputs), TwinPatcher(tiny_twin).apply_model(*tiny_inputs))
