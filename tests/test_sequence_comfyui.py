"""The sequence-parallel mode on ComfyUI's real MiniMax H3 through the real ModelPatcher.

CPU stand-in devices (every "GPU" is the CPU, 2 to 4 of them), two threads, ComfyUI's own sampler
path, attention function, LoRA patching and lowvram loading, fp32 and INT8 ConvRot checkpoints
(the official DiT format) loaded by ComfyUI's loader: the result must equal ComfyUI's unpatched
output bit for bit. With two threads a CPU GEMM slice of up to 11 rows and a 1-head attention
call can differ from the whole call (measured), so every share here keeps >= 16 rows and every
device >= 2 heads; the split refuses fewer (`test_sequence.py`). A bypass LoRA's rank-4 fp32
GEMMs can differ at any share size on some CPUs (checked at run time): there its GEMMs run one
row per call in both runs (`adapter_gemms_row_by_row`).

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_sequence_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import (
    AttentionCounter,
    CallCounter,
    TinyH3Config,
    adapter_gemms_row_by_row,
    bypass_adapted_modules,
    import_comfyui_or_skip,
    kernels_row_and_head_independent,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    preferred_attention_missing,
    run_like_sampler,
    set_preferred_attention,
    unload_all,
    with_bypass_lora,
    with_lora,
)

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.sequence import (
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence.status import COMFY_CLONES

INTERRUPTED = "InterruptProcessingException"

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]

CONFIGS = [TinyH3Config(adaln="curve", heads=4), TinyH3Config(adaln="full", heads=4)]
INT8 = TinyH3Config(adaln="curve", heads=8, weights="int8_convrot", dtype=torch.bfloat16)
WIDE = {2: TinyH3Config(heads=4), 3: TinyH3Config(heads=8), 4: TinyH3Config(heads=8)}
LONGER = (3, 8, 8)  # 16 text + 10 audio + 48 video rows = 74: >= 18 rows on each of 4 devices


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _sequence(patcher, devices: int = 2, **kwargs):
    kwargs.setdefault("chunk_heads", 1)  # raised to the CPU's 2-head minimum
    return apply_sequence_parallel(patcher, SequenceParallelConfig(
        parallel="sequence", helpers=("cpu",) * (devices - 1), **kwargs))


def _status(patcher) -> str:
    return protocol.status_lines(patcher)["sequence"]


class BlockForwards:
    """Counts calls of upstream's `DiTBlock.forward` (the class's: every model, every thread),
    recording (module id, rows, device)."""

    def __init__(self, monkeypatch):
        import comfy.ldm.minimax.model as h3

        self.calls: list[tuple[int, int, str]] = []
        original = h3.DiTBlock.forward

        def forward(block, x, *args, **kwargs):
            self.calls.append((id(block), x.shape[0], str(x.device)))
            return original(block, x, *args, **kwargs)

        monkeypatch.setattr(h3.DiTBlock, "forward", forward)

    def rows(self) -> list[int]:
        return sorted(rows for _, rows, _ in self.calls)

    def modules(self) -> int:
        return len({block for block, _, _ in self.calls})


def _shares(mode) -> list[int]:
    (seq_len,) = mode.decisions
    return [b - a for a, b in mode.split.rows_for(seq_len)]


@pytest.mark.parametrize("config", CONFIGS + [INT8], ids=["curve", "full", "int8_convrot"])
@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "keyframe+audio_mask"])
def test_equals_comfyui_unpatched(monkeypatch, config, conditioned):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=conditioned, audio_mask=conditioned)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher)
    forwards = BlockForwards(monkeypatch)
    with AttentionCounter() as calls:
        out = run_like_sampler(split, inputs)
    assert _same(base, out)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1 and mode.blocks_run == config.blocks
    # upstream's block forward ran once per share per block: the root's modules and the
    # helper's ComfyUI clone (its own modules, a model ComfyUI loaded)
    assert forwards.rows() == sorted(_shares(mode) * config.blocks)
    assert forwards.modules() == 2 * config.blocks
    assert COMFY_CLONES in _status(split)
    # ComfyUI's own attention function ran once per head chunk on each device, per block
    (seq_len,) = mode.decisions
    chunks = sum(len(mode.split.chunks_of(j, seq_len)) for j in range(2))
    assert calls.default == config.refiner_blocks + chunks * config.blocks
    assert all(b - a >= 2 for j in range(2) for a, b in mode.split.chunks_of(j, seq_len))
    assert "sequence parallel sequence" in _status(split)


@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("split", ["auto", "uneven"])
@pytest.mark.parametrize("transport", ["peer", "host"])
def test_two_three_and_four_devices_equal_unpatched(monkeypatch, devices, split, transport):
    config = WIDE[devices]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    base = run_like_sampler(patcher, inputs)
    weights = "auto" if split == "auto" else ":".join(["1.3"] + ["1"] * (devices - 1))
    split = _sequence(patcher, devices, split=weights, transport=transport)
    forwards = BlockForwards(monkeypatch)
    out = run_like_sampler(split, inputs)
    assert _same(base, out)
    mode = get_sequence_parallel(split)
    assert mode.steps["sequence"] == 1 and len(mode.devices) == devices
    shares = _shares(mode)
    # every share ran upstream's block on its own rows, once per block, each its own module
    assert min(shares) >= 16 and forwards.rows() == sorted(shares * config.blocks)
    assert forwards.modules() == devices * config.blocks
    assert mode.runner is None and len(mode.bases) == devices - 1  # buffers freed after


def test_the_startup_flags_kernel_is_sharded():
    """Every release (0.33.0: always): the kernel ComfyUI's flags made `optimized_attention`
    (negated basic attention here, whose output differs from the CPU default on any CPU), run
    per head share, equal to that kernel unpatched."""
    from comfyui_h3 import negated_basic_attention

    import_comfyui_or_skip()
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config)
    flagged = negated_basic_attention()
    default = run_like_sampler(patcher, inputs)
    with AttentionCounter(kernel=flagged) as calls:
        base = run_like_sampler(patcher, inputs)
        unpatched = calls.default
        out = run_like_sampler(_sequence(patcher), inputs)
    assert not _same(base, default) and _same(base, out)
    assert unpatched == config.refiner_blocks + config.blocks
    assert calls.default - unpatched == config.refiner_blocks + 2 * config.blocks


def test_preferred_attention_is_sharded_not_replaced():
    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    missing = preferred_attention_missing(patcher)
    if missing:
        pytest.skip(missing)
    inputs = make_inputs(config)
    with AttentionCounter() as calls:
        set_preferred_attention(patcher, calls.count_preferred(
            lambda q, k, v, heads, **kw: _sdpa(q, k, v)))
        base = run_like_sampler(patcher, inputs)
        unpatched = calls.preferred
        out = run_like_sampler(_sequence(patcher), inputs)
        set_preferred_attention(patcher, None)
    assert _same(base, out)
    assert unpatched == config.refiner_blocks + config.blocks
    assert calls.preferred - unpatched == config.refiner_blocks + 2 * config.blocks


def _sdpa(q, k, v):
    """A preferred attention: takes ComfyUI's tensor containers, returns [B, S, H*D]."""
    q, k, v = (t.take() if hasattr(t, "take") else t for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


@pytest.mark.parametrize("config", [CONFIGS[0], INT8], ids=["fp32", "int8_convrot"])
@pytest.mark.parametrize("lowvram", [False, True], ids=["loaded", "lowvram"])
def test_lora_on_off_on_reaches_the_helper(config, lowvram):
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    budget = 1 if lowvram else None
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    base = run_like_sampler(patcher, inputs, lowvram_bytes=budget)
    on = run_like_sampler(lora, inputs, lowvram_bytes=budget)
    split_plain, split_lora = _sequence(patcher), _sequence(lora)
    runs = [run_like_sampler(p, inputs, lowvram_bytes=budget)
            for p in (split_lora, split_plain, split_lora, split_plain)]
    assert not _same(base, on)
    assert _same(runs[0], on) and _same(runs[2], on)
    assert _same(runs[1], base) and _same(runs[3], base)
    assert get_sequence_parallel(split_lora).steps["sequence"] == 2


def test_int8_bypass_lora_counts_what_upstream_computes(monkeypatch):
    """A bypass LoRA on an INT8 ConvRot model: upstream's MLP runs fc2 inside
    `linear_input_act` (never `fc2.forward`), so fc2's adapter does not run unpatched; the split
    blocks compute the same (equal bits, no fc2 call) and the status says so, instead of
    counting the fc2 adapter's floor. Bit-identical with the real CPU GEMMs where they are
    row-independent at the shares (`kernels_row_and_head_independent`, rank 4 included), else
    with the adapter's GEMMs one row per call in both runs (`adapter_gemms_row_by_row`)."""
    patcher = make_tiny_h3(INT8, seed=0)
    inputs = make_inputs(INT8, keyframe=True)
    lora_sd = make_lora_state_dict(patcher, rank=4, seed=3)
    try:
        bypass = with_bypass_lora(patcher, lora_sd)
    except RuntimeError as exc:  # ComfyUIUnavailable: a ComfyUI without bypass LoRA
        pytest.skip(str(exc))
    base = run_like_sampler(patcher, inputs)
    with CallCounter(bypass) as unpatched:
        reference = run_like_sampler(bypass, inputs)
    split = _sequence(bypass)
    forwards = BlockForwards(monkeypatch)
    with CallCounter(split) as counts:
        out = run_like_sampler(split, inputs)
    assert not _same(reference, base)
    mode = get_sequence_parallel(split)
    exact_here = kernels_row_and_head_independent(
        split, sum(_shares(mode)), ffn_chunk=max(_shares(mode)), qkv_chunk=max(_shares(mode)),
        head_group=0, rank=4)
    assert _same(out, reference) or not exact_here
    # the adapters ran on the root's modules and on the helper clone's own, rebuilt for it
    # (without them the helper's rows would differ from `reference`)
    assert bypass_adapted_modules(split) == 4 * (INT8.blocks + INT8.refiner_blocks)
    assert unpatched.calls["mlp.fc2"] == counts.calls["mlp.fc2"] == 0
    assert counts.calls["mlp.fc1"] == INT8.blocks  # the root's share; the helper's below
    assert forwards.modules() == 2 * INT8.blocks
    assert mode.steps["sequence"] == 1
    assert "fc2's on-activation LoRA does not run" in _status(split)
    if not exact_here:
        # this CPU's fp32 adapter GEMMs (K -> rank 4) give a share other bits than the whole
        # call (MKL with 2 threads: 1024->4 at 25 of 50 rows), and the next INT8 linear's
        # per-row requantization makes a last-bit change a 1e-3 one: no split can equal
        # unpatched here; with upstream's adapter GEMMs one row per call in both runs, it must
        with adapter_gemms_row_by_row() as pinned:
            reference = run_like_sampler(bypass, inputs)
            out = run_like_sampler(split, inputs)
        assert pinned.calls > 0 and mode.steps["sequence"] == 2
        assert not _same(reference, base) and _same(out, reference)


@pytest.mark.parametrize("with_dual_sage", [False, True], ids=["alone", "with_dual_sage"])
def test_under_dynamic_vram_the_helpers_are_comfyui_clones(monkeypatch, with_dual_sage):
    """Under DynamicVRAM the helpers are ComfyUI's own clones (ModelPatcherDynamic there, its
    VBARs and op-time LoRA): the mode runs, exact, LoRA included, and says so. The patcher
    ComfyUI's loader returns then is a ModelPatcherDynamic, which exists on GPUs only:
    `is_dynamic()` stands in for it here (the GPU test runs the real one)."""
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage

    config = CONFIGS[0]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    reference = run_like_sampler(lora, inputs)
    dynamic = lora.clone()
    dynamic.is_dynamic = lambda: True  # what ModelPatcherDynamic answers
    if with_dual_sage:
        dynamic = apply_dual_sage(dynamic, DualSageConfig(helpers=("cpu",), min_tokens=0))
        dynamic.is_dynamic = lambda: True
    split = _sequence(dynamic)
    forwards = BlockForwards(monkeypatch)
    out = run_like_sampler(split, inputs)
    assert _same(out, reference)
    mode = get_sequence_parallel(split)
    assert mode.dynamic_vram and mode.steps["sequence"] == 1
    assert mode.blocks_run == config.blocks and forwards.modules() == 2 * config.blocks
    assert f"{COMFY_CLONES}, under DynamicVRAM" in _status(split)
    if with_dual_sage:
        shard = split.model_options["transformer_options"]["optimized_attention_override"]
        assert shard.sharded.routes.get("split", 0) == 0  # sequence took the step
    unload_all()


class Boom(Exception):
    """An error no fallback catches: it must reach the caller, every share released."""


@pytest.mark.parametrize("share", [0, 1], ids=["root_share", "helper_share"])
def test_an_error_in_one_share_releases_the_others_and_the_next_run_is_exact(monkeypatch,
                                                                             share):
    import comfy.ldm.minimax.model as h3

    config = WIDE[3]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher, 3, timeout_s=60.0)
    mode = get_sequence_parallel(split)
    original = h3.MLP.forward
    raised = []

    def mlp(module, x):  # the second block's MLP of one share (after its attention exchange)
        if not raised and mode.decisions and x.shape[0] == _shares(mode)[share] and \
                len(calls) >= 3 + share:
            raised.append(share)
            raise Boom(f"share {share}")
        calls.append(x.shape[0])
        return original(module, x)

    calls: list[int] = []
    monkeypatch.setattr(h3.MLP, "forward", mlp)
    with pytest.raises(Boom, match=f"share {share}"):
        run_like_sampler(split, inputs)
    assert raised == [share] and mode.steps["fallback"] == 0
    monkeypatch.setattr(h3.MLP, "forward", original)
    assert _same(run_like_sampler(split, inputs), base)
    assert mode.steps["sequence"] == 2


def test_a_runtime_error_in_a_helper_falls_back_to_one_device_exactly(monkeypatch):
    import comfy.ldm.minimax.model as h3

    config = WIDE[2]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher)
    mode = get_sequence_parallel(split)
    original = h3.DiTBlock.forward
    helpers = set()

    def forward(block, x, *args, **kwargs):
        if block not in patcher.model.diffusion_model.blocks and not helpers:
            helpers.add(block)
            raise torch.OutOfMemoryError("helper out of memory (simulated)")
        return original(block, x, *args, **kwargs)

    monkeypatch.setattr(h3.DiTBlock, "forward", forward)
    assert _same(run_like_sampler(split, inputs), base)
    assert helpers and mode.steps["fallback"] == 1 and mode.steps["off"] == 1


def test_comfyui_interrupt_mid_block_releases_every_share(monkeypatch):
    """ComfyUI's interrupt flag set inside one share's block: every share leaves at its next
    rendezvous, ComfyUI's InterruptProcessingException reaches the caller (flag cleared, as
    ComfyUI's own check does), and the next run is exact."""
    import comfy.ldm.minimax.model as h3
    import comfy.model_management as mm

    config = WIDE[3]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    base = run_like_sampler(patcher, inputs)
    split = _sequence(patcher, 3, timeout_s=60.0)
    mode = get_sequence_parallel(split)
    original = h3.Attention.forward
    flagged = []

    def attention(module, x, *args, **kwargs):  # a helper share, before its head exchange
        if not flagged and all(module is not m for m in patcher.model.diffusion_model.modules()):
            flagged.append(1)
            mm.interrupt_current_processing(True)
        return original(module, x, *args, **kwargs)

    monkeypatch.setattr(h3.Attention, "forward", attention)
    with pytest.raises(mm.InterruptProcessingException):
        run_like_sampler(split, inputs)
    assert flagged and not mm.processing_interrupted() and mode.steps["fallback"] == 0
    assert mode.steps["sequence"] == 1 and mode.blocks_run == 0  # left inside the first block
    workers = [w for w in mode.runner.workers if w is not None] if mode.runner else []
    assert not any(w.busy for w in workers)
    monkeypatch.setattr(h3.Attention, "forward", original)
    assert _same(run_like_sampler(split, inputs), base)
    assert mode.steps["sequence"] == 2


@pytest.mark.parametrize("order", ["sequence_last", "sequence_first"])
def test_composed_with_dual_sage_and_chunking(order):
    from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage

    config = WIDE[2]
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, latent_thw=LONGER, keyframe=True, audio_mask=True)
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    reference = run_like_sampler(lora, inputs)
    steps = [lambda p: apply_dual_sage(p, DualSageConfig(helpers=("cpu",), min_tokens=0)),
             lambda p: apply_activation_chunking(p, ChunkingConfig(ffn_chunk=23, qkv_chunk=23)),
             lambda p: _sequence(p)]
    if order == "sequence_first":
        steps = steps[::-1]
    patched = lora
    for step in steps:
        patched = step(patched)
    with CallCounter(patched) as counts:
        out = run_like_sampler(patched, inputs)
    assert _same(out, reference)
    mode = get_sequence_parallel(patched)
    assert mode.steps["sequence"] == 1  # sequence took the step; Dual-Sage stood aside
    from h3_multigpu.dual_sage import get_sharded_attention

    assert get_sharded_attention(patched).routes.get("split", 0) == 0
    # chunking ran inside the root's 45-row share (S = 90 with the keyframe): 23 + 22 rows;
    # its wrappers go on the root's modules only (no object patch for the helper clone to
    # miss), so the helper clone runs upstream's plain block on its share
    assert counts.calls["mlp.fc1"] == 2 * config.blocks
    chunkers = get_chunking(patched).chunkers
    assert sum(c.calls["mlp"] for c in chunkers.values()) == 2 * config.blocks
    assert not any("object patch" in note for note in mode.notes)
