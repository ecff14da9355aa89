"""The torch-free activation model of chunking/sizing.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3_multigpu.chunking import ChunkingConfig, sizing
from h3_multigpu.chunking.sizing import Adapters, BlockDims, Kernels
from h3_multigpu.common import floors, geometry

GiB = 1 << 30
PASS2_15S = geometry.video_audio_tokens(1312, 736, 362)  # 102,107
LORA = Adapters(rank=128, qkv=1, fc1=1)


def test_sizing_imports_without_torch():
    code = ("import sys; import h3_multigpu.chunking.sizing, h3_multigpu.chunking.config; "
            "import h3_multigpu.chunking as c; c.ChunkingConfig, c.choose_chunks; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("total, chunk", [(44, 7), (44, 5), (102_363, 16_384), (1000, 999),
                                          (5, 1), (300, 128), (130, 129), (100, 0), (10, 50)])
def test_row_chunks_cover_in_order_and_stay_balanced(total, chunk):
    ranges = sizing.row_chunks(total, chunk)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    sizes = [b - a for a, b in ranges]
    if chunk and chunk < total:
        assert max(sizes) <= chunk and len(ranges) == -(-total // chunk)
        # alignment shortens only the tail, never below half a chunk
        assert max(sizes) - min(sizes) <= len(ranges) * sizing.ROW_ALIGN
        assert min(sizes) >= max(sizes) // 2
    else:
        assert ranges == [(0, total)]


def test_large_chunks_are_tile_aligned():
    ranges = sizing.row_chunks(102_363, 16_384)
    assert all((b - a) % sizing.ROW_ALIGN == 0 for a, b in ranges[:-1])
    assert sizing.largest_chunk_rows(102_363, 16_384) == ranges[0][1]


def test_lora_on_qkv_allocates_one_more_qkv_output_the_users_4_18_gib():
    # the 15 s PASS2 failed allocating 4.18 GiB at ~104k rows: one [S, 21504] bf16 adapter output
    tokens = 104_400
    extra = (sizing.linear_call_bytes(tokens, 3 * 7168, 1, 0, 2)
             - sizing.linear_call_bytes(tokens, 3 * 7168, 0, 0, 2))
    assert extra / GiB == pytest.approx(4.18, abs=0.01)
    assert extra == tokens * geometry.activation_bytes_per_token().qkv
    # and it moves the attention phase's peak to the projection moment: x, h, qkv twice
    lora = sizing.attention_phase_peak_bytes(tokens, adapters=Adapters(rank=0, qkv=1))
    assert lora == tokens * (2 * 5376 + 2 * 3 * 7168) * 2


def test_unchunked_peaks_follow_the_tensors_alive():
    s, e = PASS2_15S, 2
    dims = BlockDims()
    x = s * dims.hidden * e
    fc1 = s * 2 * dims.ffn * e
    # the twin's MLP (tests only): x, h, fc1 and both SwiGLU temporaries at the multiply
    twin = sizing.mlp_phase_peak_bytes(s, kernels=Kernels(mlp="twin"))
    assert twin == 2 * x + fc1 + 2 * (fc1 // 2)
    # ComfyUI (the default: upstream's block): fc1 still held while fc2 writes its output
    comfy = sizing.mlp_phase_peak_bytes(s, kernels=Kernels(mlp="comfy"))
    assert comfy == 2 * x + fc1 + fc1 // 2 + x == sizing.mlp_phase_peak_bytes(s)
    # INT8: the SwiGLU product only as int8 [S, F] inside the fused fc2
    int8 = sizing.mlp_phase_peak_bytes(s, kernels=Kernels(mlp="comfy_int8"))
    assert int8 == 2 * x + fc1 + s * dims.ffn + x
    # LoRA on fc1: the base and the adapter outputs side by side
    lora = sizing.mlp_phase_peak_bytes(s, adapters=LORA)
    assert lora == 2 * x + 2 * fc1 + s * 128 * e
    assert fc1 / GiB == pytest.approx(5.45, abs=0.01)


def test_chunking_lowers_each_phase_and_more_chunks_lower_it_further():
    plain = sizing.unchunked_block_peak_bytes(PASS2_15S, adapters=LORA)
    previous = plain
    for chunk in (51_200, 16_384, 4_096):
        peak = sizing.block_peak_bytes(PASS2_15S, ffn_chunk=chunk, qkv_chunk=chunk,
                                       head_group=14, adapters=LORA)
        # smaller qkv chunks stop helping once the attention call itself dominates
        assert peak.attention_bytes <= previous.attention_bytes
        assert peak.mlp_bytes < previous.mlp_bytes
        previous = peak
    assert previous.attention_bytes < plain.attention_bytes
    # what chunking cannot remove: x, the h upstream's block holds through attention, the qkv
    # buffer and the attention output buffer
    floor = PASS2_15S * (2 * 5376 + 3 * 7168 + 7168) * 2
    assert floor < previous.attention_bytes < floor * 1.1


def test_head_groups_cap_attention_temporaries_only_when_they_dominate():
    kernels = Kernels(attention_output_copy=True)
    one_call = sizing.attention_phase_peak_bytes(PASS2_15S, qkv_chunk=8192, kernels=kernels)
    grouped = sizing.attention_phase_peak_bytes(PASS2_15S, qkv_chunk=8192, head_group=8,
                                                kernels=kernels)
    assert grouped < one_call
    no_copy = sizing.attention_phase_peak_bytes(PASS2_15S, qkv_chunk=8192, head_group=8)
    assert no_copy <= grouped


def test_choose_chunks_prefers_no_chunking_when_it_fits():
    choice = sizing.choose_chunks(100 * GiB, PASS2_15S, adapters=LORA)
    assert (choice.ffn_chunk, choice.qkv_chunk, choice.head_group) == (0, 0, 0) and choice.fits


@pytest.mark.parametrize("free_gib", [11.0, 9.0, 8.5])
def test_choose_chunks_fits_the_budget_with_the_least_chunking(free_gib):
    free = int(free_gib * GiB)
    choice = sizing.choose_chunks(free, PASS2_15S, adapters=LORA)
    x = PASS2_15S * 5376 * 2
    assert choice.fits and choice.peak.peak_bytes - x <= choice.budget_bytes
    assert choice.ffn_chunk > 0  # the unchunked 13 GiB MLP peak cannot fit
    if choice.qkv_chunk:  # a larger qkv chunk (or none) would not have fitted
        bigger = sizing.attention_phase_peak_bytes(PASS2_15S, qkv_chunk=0,
                                                   head_group=choice.head_group, adapters=LORA)
        assert bigger - x > choice.budget_bytes


def test_choose_chunks_reports_what_cannot_fit_and_keeps_given_values():
    impossible = sizing.choose_chunks(GiB, PASS2_15S, adapters=LORA)
    # the most aggressive exact settings: 4 heads per call, chunks of at least 4096 rows
    assert not impossible.fits and impossible.head_group == min(sizing.HEAD_GROUP_CANDIDATES)
    assert impossible.ffn_chunk >= floors.MIN_AUTO_CHUNK_ROWS
    kept = sizing.choose_chunks(9 * GiB, PASS2_15S, adapters=LORA, qkv_chunk=4096,
                                head_group=0)
    assert kept.qkv_chunk == 4096 and kept.head_group == 0 and kept.ffn_chunk > 0


def test_auto_head_groups_only_where_each_call_keeps_enough_query_tiles():
    tight = dict(adapters=LORA, kernels=Kernels(attention_output_copy=True), qkv_chunk=1024)
    long_pass = sizing.choose_chunks(0, PASS2_15S, **tight)
    assert long_pass.head_group == 4  # the smallest group "auto" uses
    short = sizing.choose_chunks(0, 8000, **tight)  # 125 tiles per head
    assert short.head_group * 125 >= floors.MIN_QUERY_TILES_PER_CALL


def test_sizing_rejects_bad_values():
    with pytest.raises(ValueError, match="ffn_chunk"):
        sizing.mlp_phase_peak_bytes(100, ffn_chunk=-1)
    with pytest.raises(ValueError, match="tokens"):
        sizing.block_peak_bytes(-5)
    with pytest.raises(ValueError, match="free_bytes"):
        sizing.choose_chunks(-1, 100)
    with pytest.raises(ValueError, match="mlp kernel"):
        Kernels(mlp="fused")


@pytest.mark.parametrize("total, chunk", [(6_200, 4096), (8_193, 4096), (8_193, 8192),
                                          (35_561, 4096), (35_561, 5000), (102_363, 4224),
                                          (4_097, 4096), (12_287, 4096)])
def test_row_chunks_never_go_below_the_exactness_floor(total, chunk):
    """A request at or above EXACT_MIN_ROWS never produces a GEMM call below it (cuBLAS would
    pick another kernel there on an H200): fewer, larger chunks are used instead."""
    ranges = sizing.row_chunks(total, chunk)
    sizes = [b - a for a, b in ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == total and sum(sizes) == total
    assert min(sizes) >= floors.EXACT_MIN_ROWS or ranges == [(0, total)]
    # larger than asked only by less than the floor, and only when the floor forced it
    assert max(sizes) < max(chunk, 2 * floors.EXACT_MIN_ROWS)
    assert sizing.largest_chunk_rows(total, chunk) == max(sizes)


def test_small_explicit_row_chunks_are_honoured():
    assert [b - a for a, b in sizing.row_chunks(3320, 777)] == [664] * 5
    assert max(b - a for a, b in sizing.row_chunks(3320, 64)) <= 64


@pytest.mark.parametrize("heads, group, tokens, expected", [
    (56, 14, 35_561, [14, 14, 14, 14]),
    (56, 12, 35_561, [12, 11, 11, 11, 11]),   # balanced: no 8-head tail call
    (56, 5, 35_561, [5] * 8 + [4] * 4),       # no 1-head tail call either
    (56, 14, 3_320, [28, 28]),                # 52 query tiles: >= 20 heads per call
    (56, 4, 8_000, [10, 10, 9, 9, 9, 9]),     # 125 tiles: >= 9 heads per call
    (56, 28, 2_000, [56]),                    # too short for any exact split: one call
    (56, 2, 3_320, [2] * 28),                 # below the head floor: as asked
    (8, 3, 44, [3, 3, 2]),
    (56, 0, 35_561, [56]), (56, 56, 35_561, [56]),
])
def test_head_groups_balance_and_keep_the_exactness_floor(heads, group, tokens, expected):
    ranges = sizing.head_groups(heads, group, tokens)
    assert [b - a for a, b in ranges] == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == heads
    calls = len(ranges)
    if group >= floors.EXACT_MIN_HEADS and calls > 1:
        tiles = sizing.query_tiles(tokens)
        assert min(expected) * tiles >= floors.MIN_QUERY_TILES_PER_CALL
    assert sizing.largest_head_group(heads, group, tokens) == (0 if calls == 1 else max(expected))


def test_status_says_exact_only_inside_the_floors():
    def status(**kw):
        return ChunkingConfig(**kw).status(40)

    for exact in (dict(ffn_chunk=4096, qkv_chunk=16384, head_group=14),
                  dict(ffn_chunk="auto", qkv_chunk="auto", head_group="auto"),
                  dict(ffn_chunk=4096), dict(head_group=4)):
        assert status(**exact).endswith("; exact"), exact
    for inexact, named in ((dict(ffn_chunk=333, qkv_chunk=777, head_group=5), "ffn chunks of 333"),
                           (dict(ffn_chunk=64, qkv_chunk=64, head_group=1), "1 heads per"),
                           (dict(qkv_chunk=4095), "qkv chunks of 4095"),
                           (dict(head_group=3), "3 heads per attention call")):
        line = status(**inexact)
        assert "exact" not in line.replace("may differ", "") and named in line, line
        assert "may differ from unchunked at bf16 rounding" in line


def test_planner_chunks_stay_inside_the_floors():
    """The planner's row chunks and head groups are exact ones (4096+ rows, 4+ heads)."""
    from h3_multigpu.planner import BlockDims, choose_chunks

    for tokens in (8_000, 35_561, 68_962, 102_363):
        for free in (0, 4 * GiB, 8 * GiB):
            settings = choose_chunks(free, tokens, BlockDims(), lora_on_activations=True)
            assert sizing.exactness_note(settings.ffn_chunk, settings.qkv_chunk,
                                         settings.head_group) == "exact", settings
