"""Chunking inside the real ComfyUI: the real MiniMaxH3 class through the real ModelPatcher and
sampler path (tests/comfyui_h3.py), with weight-patch LoRA (full and lowvram), on-activation
(bypass) LoRA, LoRA on/off/on cycles, a keyframe and an audio mask, against ComfyUI's own
unpatched output; and ComfyUI's own H3 block with its bypass hook.

    COMFYUI_PATH=/path/to/ComfyUI-with-H3 python -m pytest -m comfyui tests/test_chunking_comfyui.py

Exactness on the CPU: the chunked model must equal the unpatched one bit for bit wherever this
machine's kernels are row- and head-independent for the chunk sizes used (checked at run time by
`kernels_row_and_head_independent`); elsewhere (multi-threaded BLAS splitting rows) within the
fp32 reordering bound FP32_REORDER_BOUND. Every case counts that chunking engaged.
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
    lowvram_patched_modules,
    make_inputs,
    make_lora_state_dict,
    make_tiny_h3,
    run_like_sampler,
    with_bypass_lora,
    with_lora,
)

from h3_multigpu.chunking import (
    ChunkingConfig,
    apply_activation_chunking,
    get_chunking,
    sizing,
)
from h3_multigpu.comfy_seam import h3 as seam_h3
from h3_multigpu.comfy_seam import protocol
from h3_multigpu.comfy_seam.h3 import weight_format
from h3_multigpu.common import exact_rows
from h3_multigpu.common import floors as common_floors
from h3_multigpu.common.formats import activation_adapters

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]


@pytest.fixture(scope="module")
def comfy_h3():
    # skips with the reason when ComfyUI cannot be imported here at all (missing requirements,
    # RuntimeError from a GPU-less machine, no H3 model)
    comfy = import_comfyui_or_skip()
    try:
        from comfy.weight_adapter.bypass import BypassForwardHook
        from comfy.weight_adapter.lora import LoRAAdapter
    except ImportError as exc:  # a ComfyUI without bypass LoRA
        pytest.skip(f"this ComfyUI has no bypass LoRA (comfy.weight_adapter.bypass): {exc}")

    h3 = comfy.ldm.minimax.model
    return h3, comfy.ops, comfy.model_management, BypassForwardHook, LoRAAdapter


def _block(comfy_h3, device):
    h3, ops, *_ = comfy_h3
    torch.manual_seed(0)
    block = h3.DiTBlock(64, 8, 16, 96, 8, 1e-5, 1e-5, apply_silu=False,
                        adaln_dtype=torch.float32, dtype=torch.bfloat16, device=device,
                        operations=ops.disable_weight_init)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    return block.requires_grad_(False).eval()  # as ComfyUI's BaseModel leaves the DiT


def test_seam_reads_comfyui_block(comfy_h3):
    h3 = comfy_h3[0]
    block = _block(comfy_h3, "cpu")
    assert seam_h3.is_comfyui(block) and seam_h3.default_attention(block) is h3.optimized_attention
    assert seam_h3.mlp_kernel(block) == "comfy" and not seam_h3.fused_int8_fc2(block)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "bypass-lora"])
def test_comfyui_block_chunked_is_bit_identical(comfy_h3, lora):
    h3, _, mm, bypass_hook, lora_adapter = comfy_h3
    device = mm.get_torch_device()
    block = _block(comfy_h3, device)
    hooks = []
    if lora:
        for linear in (block.attn.qkv_proj, block.mlp.fc1):
            gen = torch.Generator().manual_seed(linear.out_features)
            up = torch.randn(linear.out_features, 4, generator=gen) * 0.1
            down = torch.randn(4, linear.in_features, generator=gen) * 0.1
            adapter = lora_adapter(set(), (up, down, 4.0, None, None, None))
            hook = bypass_hook(linear, adapter, multiplier=0.7)
            hook.inject()
            hooks.append(hook)
        assert activation_adapters(block.attn.qkv_proj) == (1, 4)
    # 8,200 rows: GEMM chunks of >= 1,000 rows and >= 128 query tiles per head (see sizing)
    s = 8200
    x = torch.randn(s, 64, dtype=torch.bfloat16, device=device)
    t_emb = torch.randn(2, 8, device=device)
    segments = [(0, 300, 1), (300, 1300, 5), (1300, s, 0)]
    rope = h3.rope_rotation_table(torch.randn(s, 8, device=device), torch.bfloat16)
    from h3_multigpu.chunking.wrappers import BlockChunker, ChunkingRuntime, HeadGroups

    with torch.inference_mode():
        reference = block.forward(x.clone(), t_emb, segments, rope, transformer_options={})
        for config in (ChunkingConfig(ffn_chunk=3000, qkv_chunk=2100, head_group=3),
                       ChunkingConfig(ffn_chunk=1000)):
            runtime = ChunkingRuntime()
            chunker = runtime.chunkers[0] = BlockChunker(block, config, None, runtime)
            options = {"optimized_attention_override": HeadGroups(runtime)}
            with runtime.wrapped():  # upstream's own block forward, its modules row-chunked
                out = block.forward(x.clone(), t_emb, segments, rope,
                                    transformer_options=options)
            assert torch.equal(out, reference)
            qkv = len(sizing.row_chunks(s, config.qkv_chunk, chunker.last_plan.qkv_floor))
            assert chunker.calls == {"attn.qkv_proj": qkv, "attn.out_proj": qkv,
                                     "mlp": len(sizing.row_chunks(s, config.ffn_chunk,
                                                                  chunker.last_plan.ffn_floor))}
            assert chunker.calls["mlp"] > 1
    for hook in hooks:
        hook.eject()


# ------------------------------------------------------------------------------------------------
# The whole real model through the real ModelPatcher and sampler path
# ------------------------------------------------------------------------------------------------

CONFIG = TinyH3Config(heads=8)  # 8 heads of 128 dims (inner 1024) over hidden 256, 2 DiT blocks
# fp32 reordering bound for kernels that split rows differently: a K-term fp32 sum reordered
# differs by about sqrt(K) * 2^-24 relative (random walk of the roundings); k = 4 per GEMM stage,
# times the model's GEMM stages (5 per block: qkv, attention, out_proj, fc1, fc2).
K_MAX = 1024
FP32_REORDER_BOUND = 4 * K_MAX ** 0.5 * 2.0 ** -24 * 5 * CONFIG.blocks
EXPLICIT = ChunkingConfig(ffn_chunk=13, qkv_chunk=17, head_group=3)  # nothing divides S or 8


@pytest.fixture(scope="module")
def lora_sd():
    import_comfyui_or_skip()
    return make_lora_state_dict(make_tiny_h3(CONFIG, seed=0), rank=4, seed=3)


def _same_as_unpatched(out, ref, patcher, tokens, chunks, rank=0):
    """Bit-identical where this machine's kernels are row/head independent, else fp32-close."""
    exact_here = kernels_row_and_head_independent(
        patcher, tokens, ffn_chunk=chunks[0], qkv_chunk=chunks[1], head_group=chunks[2],
        rank=rank)
    for a, b in zip(out, ref, strict=True):
        if exact_here:
            assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item():.3e}"
        else:
            rel = ((a - b).norm() / b.norm()).item()
            assert rel <= FP32_REORDER_BOUND, f"relative L2 {rel:.2e}"


def _engaged(counts: CallCounter, attention: AttentionCounter, chunks, tokens, wrapped=None):
    """Chunking ran: the wrapped modules ran once per row chunk (fc1 inside each MLP chunk),
    attention once per head group."""
    ffn, qkv, group = chunks
    fc1 = len(sizing.row_chunks(tokens, ffn))
    proj = len(sizing.row_chunks(tokens, qkv))
    groups = len(sizing.head_groups(CONFIG.heads, group, tokens))
    assert fc1 * proj * groups > 1, chunks  # something was chunked
    assert counts.per_block("mlp.fc1") == counts.per_block("mlp.fc2") == fc1
    assert counts.per_block("attn.qkv_proj") == counts.per_block("attn.out_proj") == 1
    if wrapped is not None:  # chunk calls through the wrappers, per block call
        assert wrapped == {"attn.qkv_proj": proj, "attn.out_proj": proj, "mlp": fc1}, wrapped
    # the call sites are entered once per block; the kernel runs once per head group
    assert attention.entered - CONFIG.refiner_blocks == CONFIG.blocks
    assert attention.default - CONFIG.refiner_blocks == CONFIG.blocks * groups


def _wrapper_calls(patcher) -> dict[str, int]:
    runtime = get_chunking(patcher)
    if runtime is None:
        return {}
    total: dict[str, int] = {}
    for chunker in runtime.chunkers.values():
        for name, n in chunker.calls.items():
            total[name] = total.get(name, 0) + n
    return total


def _run(patcher, inputs, **kwargs):
    before = _wrapper_calls(patcher)
    with CallCounter(patcher) as counts, AttentionCounter() as attention:
        out = run_like_sampler(patcher, inputs, **kwargs)
    after = _wrapper_calls(patcher)
    block_calls = max(len(counts.rows), 1)
    counts.wrapped = {name: (after[name] - before.get(name, 0)) / block_calls for name in after}
    return out, counts, attention


def _chunks(patcher) -> tuple[int, int, int]:
    return get_chunking(patcher).chunkers[0].last_chunks


def _auto_on_a_full_device(monkeypatch) -> ChunkingConfig:
    """"auto" on a device with no free memory, the GPU's exactness floors scaled down to this
    ~100-row, 8-head model (the GPU's floors would not chunk a sequence this short at all)."""
    monkeypatch.setattr("h3_multigpu.chunking.wrappers.free_device_bytes", lambda device: 0)
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", 24)
    monkeypatch.setattr(common_floors, "MIN_QUERY_TILES_PER_CALL", 2)
    return ChunkingConfig("auto", "auto", "auto", headroom_bytes=0)


CASES = ["plain", "keyframe+audio_mask", "lora", "lora_lowvram", "bypass_lora"]


@pytest.mark.parametrize("case", CASES)
def test_chunked_real_model_equals_unpatched(case, lora_sd, monkeypatch):
    patcher = make_tiny_h3(CONFIG, seed=0)
    conditioned = case != "plain"
    inputs = make_inputs(CONFIG, keyframe=conditioned, audio_mask=conditioned)
    run_kwargs, rank = {}, 0
    if case in ("lora", "lora_lowvram"):
        patcher = with_lora(patcher, lora_sd)
        if case == "lora_lowvram":
            run_kwargs["lowvram_bytes"] = 1
    elif case == "bypass_lora":
        try:
            patcher = with_bypass_lora(patcher, lora_sd)
        except RuntimeError as exc:  # ComfyUIUnavailable: a ComfyUI without bypass LoRA
            pytest.skip(str(exc))
        rank = 4
    reference, _, _ = _run(patcher, inputs, **run_kwargs)
    for config in (EXPLICIT, _auto_on_a_full_device(monkeypatch)):
        chunked = apply_activation_chunking(patcher, config)
        out, counts, attention = _run(chunked, inputs, **run_kwargs)
        tokens = counts.rows[0]
        chunks = _chunks(chunked)
        _engaged(counts, attention, chunks, tokens, counts.wrapped)
        if case == "lora_lowvram":
            assert lowvram_patched_modules(chunked) > 0  # the LoRA rode ComfyUI's LowVramPatch
        if case == "bypass_lora":
            assert bypass_adapted_modules(chunked) == 4 * (CONFIG.blocks + CONFIG.refiner_blocks)
        _same_as_unpatched(out, reference, chunked, tokens, chunks, rank)
        line = protocol.status_lines(chunked)["chunking"]
        assert line.endswith("exact") == (config is not EXPLICIT), line


def test_lora_cycles_with_chunking_equal_unpatched_cycles(lora_sd):
    """base -> LoRA -> base -> LoRA -> bypass LoRA -> base, chunked, each equal to ComfyUI's
    unpatched result: ComfyUI's weight backups and unpatching are untouched by chunking."""
    base = make_tiny_h3(CONFIG, seed=0)
    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    lora = with_lora(base, lora_sd)
    try:
        bypass = with_bypass_lora(base, lora_sd)
    except RuntimeError as exc:  # ComfyUIUnavailable: a ComfyUI without bypass LoRA
        pytest.skip(str(exc))
    plain_ref = run_like_sampler(base, inputs)
    lora_ref = run_like_sampler(lora, inputs)
    bypass_ref = run_like_sampler(bypass, inputs)
    assert not torch.equal(plain_ref[0], lora_ref[0])
    assert not torch.equal(plain_ref[0], bypass_ref[0])
    base_c, lora_c, bypass_c = (apply_activation_chunking(p, EXPLICIT)
                                for p in (base, lora, bypass))
    sequence = [(base_c, plain_ref, 0), (lora_c, lora_ref, 0), (base_c, plain_ref, 0),
                (lora_c, lora_ref, 0), (bypass_c, bypass_ref, 4), (base_c, plain_ref, 0),
                (bypass_c, bypass_ref, 4), (lora_c, lora_ref, 0)]
    for step, (patcher, ref, rank) in enumerate(sequence):
        out, counts, attention = _run(patcher, inputs)
        _engaged(counts, attention, _chunks(patcher), counts.rows[0], counts.wrapped)
        _same_as_unpatched(out, ref, patcher, counts.rows[0], _chunks(patcher), rank)
        assert bypass_adapted_modules(patcher) == (0 if rank == 0 else 16), step


# ------------------------------------------------------------------------------------------------
# INT8 ConvRot weights (the official DiT format), loaded by ComfyUI's own loader
# ------------------------------------------------------------------------------------------------

INT8 = TinyH3Config(heads=8, weights="int8_convrot", dtype=torch.bfloat16)
# S = 44 / 50 rows: two chunks of 22-25 rows per phase, above the CPU's measured row floor
ROWS = ChunkingConfig(ffn_chunk=24, qkv_chunk=30)
CPU_MIN_ROWS = 16  # fp32 slices of up to 11 rows differ with 2 threads (INT8 eager kernel too);
# not the rank-4 adapter GEMMs of every CPU (`adapter_gemms_row_by_row`)


@pytest.mark.parametrize("case", CASES)
def test_int8_convrot_chunked_equals_unpatched(case, lora_sd, monkeypatch):
    """INT8 ConvRot weights loaded by ComfyUI's loader, chunked, against unpatched ComfyUI:
    weight-patch LoRA (requantized INT8), lowvram LoRA (ComfyUI's cast dequantizes: a plain
    GEMM), bypass LoRA (its fc2 adapter does not run in upstream's INT8 MLP, whose
    `linear_input_act` never calls fc2.forward: not unpatched, not chunked, and the status says
    so). On the CPU ComfyUI computes in fp32 and the eager INT8 kernel keeps the CPU row rule
    (`exact_rows`), scaled here to the measured 16 rows; the NVIDIA any-rows rule is the `gpu`
    test's (test_chunking_int8_gpu). Bit-identical always: with the real CPU GEMMs where they
    are row-independent at these chunks (`kernels_row_and_head_independent`, the LoRA's rank
    included), else with the bypass adapter's GEMMs one row per call in both runs."""
    monkeypatch.setattr(common_floors, "EXACT_MIN_ROWS", CPU_MIN_ROWS)
    patcher = make_tiny_h3(INT8, seed=0)
    block = patcher.model.diffusion_model.blocks[0]
    assert seam_h3.fused_int8_fc2(block)
    assert weight_format(block.mlp.fc1) == "int8_convrot"
    conditioned = case != "plain"
    inputs = make_inputs(INT8, keyframe=conditioned, audio_mask=conditioned)
    run_kwargs = {}
    if case in ("lora", "lora_lowvram"):
        patcher = with_lora(patcher, lora_sd)
        if case == "lora_lowvram":
            run_kwargs["lowvram_bytes"] = 1
    elif case == "bypass_lora":
        try:
            patcher = with_bypass_lora(patcher, lora_sd)
        except RuntimeError as exc:  # ComfyUIUnavailable: a ComfyUI without bypass LoRA
            pytest.skip(str(exc))
    base = run_like_sampler(make_tiny_h3(INT8, seed=0), inputs)
    reference, ref_counts, _ = _run(patcher, inputs, **run_kwargs)
    chunked = apply_activation_chunking(patcher, ROWS)
    out, counts, attention = _run(chunked, inputs, **run_kwargs)
    tokens = counts.rows[0]
    forward = get_chunking(chunked).chunkers[0]
    plan = forward.last_plan
    assert counts.per_block("mlp.fc1") == len(sizing.row_chunks(tokens, 24, plan.ffn_floor)) > 1
    assert counts.wrapped["attn.qkv_proj"] == len(sizing.row_chunks(tokens, 30,
                                                                    plan.qkv_floor)) > 1
    assert counts.wrapped["attn.out_proj"] == counts.wrapped["attn.qkv_proj"]
    # fc2 is computed inside linear_input_act: its forward never runs, unpatched or chunked
    assert counts.calls["mlp.fc2"] == ref_counts.calls["mlp.fc2"] == 0
    if case == "bypass_lora" and not kernels_row_and_head_independent(
            chunked, tokens, ffn_chunk=ROWS.ffn_chunk, qkv_chunk=ROWS.qkv_chunk, head_group=0,
            rank=4):
        # this CPU's fp32 adapter GEMMs (K -> rank 4) give a row slice other bits than the
        # whole call (MKL with 2 threads: 1024->4), so no row split equals unpatched here, and
        # the next INT8 linear's per-row requantization makes a last-bit change a 1e-3 one:
        # compare with upstream's adapter GEMMs pinned to one row per call in both runs
        with adapter_gemms_row_by_row() as pinned:
            reference = run_like_sampler(patcher, inputs, **run_kwargs)
            out = run_like_sampler(chunked, inputs, **run_kwargs)
        assert pinned.calls > 0
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    lora = case in ("lora", "lora_lowvram", "bypass_lora")  # it changes the output
    assert lora != all(torch.equal(a, b) for a, b in zip(out, base, strict=True))
    line = protocol.status_lines(chunked)["chunking"]
    assert line.endswith("; exact"), line
    formats = dict(forward.weight_formats())
    if case == "lora_lowvram":
        assert lowvram_patched_modules(chunked) > 0
        assert formats["fc1"] in exact_rows.PLAIN_FORMATS  # dequantized: a plain GEMM
    else:
        assert formats["fc1"] == "int8_convrot"
    skipped = "fc2's on-activation LoRA does not run"
    assert (skipped in line) == (case == "bypass_lora"), line
    if case == "bypass_lora":
        assert bypass_adapted_modules(chunked) == 4 * (INT8.blocks + INT8.refiner_blocks)
        assert dict(forward.adapter_ranks()) == {"qkv_proj": (4,), "out_proj": (4,),
                                                 "fc1": (4,), "fc2": ()}


def test_head_groups_run_the_modules_preferred_attention(monkeypatch):
    """Newest files: a checkpoint's per-module preferred attention is what ComfyUI runs; the
    head-group override (which wrap_attn calls with ComfyUI's default as `func`) must run the
    preferred function per group, as the unpatched call runs it whole."""
    from comfyui_h3 import preferred_attention_missing, set_preferred_attention

    patcher = make_tiny_h3(CONFIG, seed=0)
    why = preferred_attention_missing(patcher)
    if why:
        pytest.skip(why)
    comfy = import_comfyui_or_skip()
    h3 = comfy.ldm.minimax.model
    default = getattr(h3.optimized_attention, "__wrapped__", h3.optimized_attention)
    heads_seen = []

    def counted(q, k, v, heads, *args, **kwargs):
        heads_seen.append(heads)
        return default(q, k, v, heads, *args, **kwargs)

    # registered attention functions are wrap_attn-wrapped: they take ComfyUI's containers
    preferred = comfy.ldm.modules.attention.wrap_attn(counted)

    inputs = make_inputs(CONFIG, keyframe=True, audio_mask=True)
    assert set_preferred_attention(patcher, preferred) > 0
    try:
        reference = run_like_sampler(patcher, inputs)
        unpatched = list(heads_seen)
        heads_seen.clear()
        chunked = apply_activation_chunking(patcher, ChunkingConfig(head_group=3))
        out = run_like_sampler(chunked, inputs)
    finally:
        set_preferred_attention(patcher, None)
    assert unpatched.count(CONFIG.heads) >= CONFIG.blocks
    assert heads_seen.count(3) == 2 * CONFIG.blocks and heads_seen.count(2) == CONFIG.blocks
    _same_as_unpatched(out, reference, chunked, 0, (0, 0, 3))
