import pytest

from h3_multigpu.common import geometry

TOKEN_TABLE = {  # H3_FACTS section 3
    (864, 480): {124: 15_399, 243: 29_970, 294: 36_215, 362: 44_541},
    (1312, 736): {124: 35_305, 243: 68_706, 294: 83_021, 362: 102_107},
}


@pytest.mark.parametrize("seconds,frames", [(5, 124), (10, 243), (12, 294), (15, 362),
                                            (0.1, 5), (1, 39)])
def test_snap_frames(seconds, frames):
    assert geometry.snap_frames(seconds) == frames
    assert geometry.validate_frames(frames) == frames


@pytest.mark.parametrize("canvas", list(TOKEN_TABLE))
def test_token_table(canvas):
    for frames, tokens in TOKEN_TABLE[canvas].items():
        assert geometry.video_audio_tokens(*canvas, frames) == tokens


def test_latent_shapes():
    assert geometry.latent_shape(864, 480, 124) == (1, 24, 37, 30, 54)
    assert geometry.latent_shape(1312, 736, 362) == (1, 24, 107, 46, 82)
    assert geometry.audio_latent_shape(124) == (1, 32, 2, 207)
    assert geometry.latent_frames(5) == 2
    assert geometry.tokens_per_latent_frame(864, 480) == 405
    assert geometry.tokens_per_latent_frame(1312, 736) == 943


def test_activation_bytes_match_facts():
    b = geometry.activation_bytes_per_token()
    assert (b.hidden, b.qkv, b.attention_out, b.fc1, b.swiglu) == (10_752, 43_008, 14_336,
                                                                   57_344, 28_672)
    # "at 102k tokens the fc1 output alone is 5.45 GiB and the qkv output 4.09 GiB"
    assert round(102_107 * b.fc1 / 2**30, 2) == 5.45
    assert round(102_107 * b.qkv / 2**30, 2) == 4.09


def test_bad_canvas_names_value_and_fix():
    with pytest.raises(ValueError, match=r"1296x720.*use 1312x736"):
        geometry.validate_canvas(1296, 720)
    with pytest.raises(ValueError, match="positive"):
        geometry.validate_canvas(0, 480)
    with pytest.raises(ValueError, match="integer"):
        geometry.validate_canvas(864.0, 480)


def test_bad_frames_and_seconds():
    with pytest.raises(ValueError, match=r"125.*use 124 or 141"):
        geometry.validate_frames(125)
    with pytest.raises(ValueError, match="positive"):
        geometry.snap_frames(0)
    with pytest.raises(ValueError, match="number"):
        geometry.snap_frames("5")
    with pytest.raises(ValueError, match="too small"):
        geometry.validate_frames(3)


def test_pass_geometry():
    g = geometry.PassGeometry.from_seconds(1312, 736, 15)
    assert g.frames == 362 and g.tokens == 102_107 and not g.over_native_area
    assert geometry.PassGeometry(1344, 768, 124).over_native_area is False
    assert geometry.PassGeometry(1376, 768, 124).over_native_area is True
    assert geometry.attention_flops(1000) == 4 * 1000 * 1000 * 128 * 56
