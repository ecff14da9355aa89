"""Video decode shared between devices: CPU stand-ins for the GPUs, bit-identical to one call.

Every "device" is the CPU; each helper still gets its own decoding copy of the model, its own
worker and writer threads, and the boundary pieces still travel between lanes, so the window
cut, the hand-over and the cross-fade are exercised as on GPUs. The reference is the stand-in's
own one-device loop (`decode_temporal`); the real upstream class is in test_decode_comfyui.py.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from decode_standin import FakeVAE, StandInVideoVAE

from h3_multigpu.decode import WindowLayout, assign_windows, frames_to_latents, parse_weights
from h3_multigpu.decode.apply import (
    MultiGPUDecode,
    MultiGPUDecodeConfig,
    apply_multi_gpu_decode,
    find_patch,
)
from h3_multigpu.decode.executor import SplitDecode
from h3_multigpu.decode.release import check_splittable
from h3_multigpu.decode.replica import check_replicable, make_replica
from h3_multigpu.decode.shares import DecodeReport, DeviceShare

CPU = torch.device("cpu")


def _latent(t: int, seed: int = 1, h: int = 2, w: int = 7) -> torch.Tensor:
    return torch.randn(1, 24, t, h, w, generator=torch.Generator().manual_seed(seed))


def _reference(model: StandInVideoVAE, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.decode_temporal(z.clone())


def _split(model, z, ranges, **kwargs) -> tuple[torch.Tensor, DecodeReport]:
    shares = [DeviceShare(CPU, r, model if d == 0 else None) for d, r in enumerate(ranges)]
    out = torch.full(model.decode_output_shape(z.shape), float("nan"))
    with torch.no_grad():
        report = SplitDecode(model, WindowLayout.from_model(model), shares, output=out,
                             **kwargs).run(z)
    return out, report


# --- the windows -------------------------------------------------------------------------------

@pytest.mark.parametrize("frames,latents,windows", [(124, 37, 7), (243, 72, 14), (362, 107, 21),
                                                    (22, 7, 1)])
def test_layout_counts_windows_and_frames_of_the_h3_grid(frames, latents, windows):
    layout = WindowLayout()
    assert frames_to_latents(frames) == latents
    assert layout.windows(latents) == (0, windows)
    assert layout.written_frames(windows) == frames
    assert (layout.head_frames, layout.tail_frames, layout.blend_frames) == (17, 5, 5)


def test_layout_reads_the_model_and_refuses_other_modules():
    assert WindowLayout.from_model(StandInVideoVAE()) == WindowLayout()
    with pytest.raises(ValueError, match="tokens_chunk_size"):
        WindowLayout.from_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("t", [2, 3, 8, 10, 11, 12, 13])
def test_layout_pads_like_the_model(t):
    assert WindowLayout().windows(t) == StandInVideoVAE()._decode_temporal_chunks(t)


def test_assign_windows_balances_equal_and_weighted_devices():
    assert assign_windows(21, [1.0, 1.0]) == [(0, 11), (11, 21)]
    assert assign_windows(14, [1.0, 1.0]) == [(0, 7), (7, 14)]
    # a device twice as slow gets about a third; the ranges stay contiguous and cover all
    ranges = assign_windows(21, [1.0, 2.0])
    assert ranges == [(0, 14), (14, 21)]
    three = assign_windows(20, [1.0, 1.0, 2.0])
    assert three[0][0] == 0 and three[-1][1] == 20 and [b - a for a, b in three] == [8, 8, 4]
    # a helper that starts late (copying the decoder) gets fewer windows
    assert assign_windows(14, [1.0, 1.0], [0.0, 2.0]) == [(0, 8), (8, 14)]


def test_parse_weights_names_the_fix():
    assert parse_weights("auto", 2) is None
    assert parse_weights("1:0.5", 2) == (1.0, 0.5)
    with pytest.raises(ValueError, match="root first"):
        parse_weights("1:1:1", 2)
    with pytest.raises(ValueError, match="positive"):
        parse_weights("1:0", 2)


# --- bit identity ------------------------------------------------------------------------------

@pytest.mark.parametrize("t,ranges", [
    (12, [(0, 1), (1, 2)]),
    (17, [(0, 2), (2, 3)]),
    (17, [(0, 1), (1, 3)]),
    (37, [(0, 4), (4, 7)]),  # 124 frames, scaled down in space
    (37, [(0, 1), (1, 5), (5, 7)]),  # three devices, uneven
    (72, [(0, 7), (7, 14)]),  # 243 frames
    (72, [(0, 3), (3, 12), (12, 14)]),
    (10, [(0, 1), (1, 2)]),  # a latent off the 5k+2 grid: padded like the model
])
def test_split_decode_is_bit_identical_to_one_call(t, ranges):
    model = StandInVideoVAE()
    z = _latent(t)
    expected = _reference(model, z)
    model.calls.clear()
    out, report = _split(model, z, ranges)
    assert torch.equal(out, expected)
    # each device decoded exactly its own windows, on its own module (copies for helpers)
    per_module = {}
    for c in model.calls:
        per_module[c] = per_module.get(c, 0) + 1
    assert sorted(per_module.values()) == sorted(b - a for a, b in ranges)
    assert per_module[id(model.decoder)] == ranges[0][1] - ranges[0][0]
    assert report.handovers == len(ranges) - 1  # one 5-frame piece per cut
    assert report.same_tile_batches and len(report.tile_batches) == ranges[-1][1]


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_every_cut_position_is_exact_in_bf16(cut):
    model = StandInVideoVAE(dtype=torch.bfloat16)
    z = _latent(22).to(torch.bfloat16)
    expected = _reference(model, z)
    out, _ = _split(model, z, [(0, cut), (cut, 4)])
    assert torch.equal(out, expected)


def test_split_writes_into_the_callers_buffer_only():
    model = StandInVideoVAE()
    z = _latent(17)
    out = torch.full(model.decode_output_shape(z.shape), float("nan"))
    ptr = out.data_ptr()
    shares = [DeviceShare(CPU, (0, 2), model), DeviceShare(CPU, (2, 3))]
    with torch.no_grad():
        SplitDecode(model, WindowLayout(), shares, output=out).run(z)
    assert out.data_ptr() == ptr and not out.isnan().any()


def test_shares_must_cover_the_windows_in_order():
    model = StandInVideoVAE()
    z = _latent(17)
    with pytest.raises(ValueError, match="do not cover"):
        _split(model, z, [(0, 1), (2, 3)])


# --- progress, interrupt, failure ------------------------------------------------------------

def test_the_roots_windows_run_on_the_calling_thread_and_each_helper_on_its_own():
    """As ComfyUI's multi-GPU thread pool runs devices: the main one on the caller's thread."""
    model = StandInVideoVAE()
    _split(model, _latent(37), [(0, 3), (3, 5), (5, 7)])
    root = id(model.decoder)
    here = threading.current_thread().name
    assert {t for c, t in zip(model.calls, model.call_threads, strict=True) if c == root} == {here}
    helpers = {t for c, t in zip(model.calls, model.call_threads, strict=True) if c != root}
    assert len(helpers) == 2 and here not in helpers


def test_progress_counts_each_window_once():
    model = StandInVideoVAE()
    steps = []
    _split(model, _latent(37), [(0, 3), (3, 7)], progress=steps.append)
    assert steps == [1] * 7


class _Interrupted(Exception):
    pass


def test_interrupt_stops_the_workers_and_raises():
    model = StandInVideoVAE()
    seen = []

    def check():
        if seen:
            raise _Interrupted("stopped by the user")

    with pytest.raises(_Interrupted):
        _split(model, _latent(72), [(0, 7), (7, 14)], progress=seen.append,
               check_interrupt=check, poll_seconds=0.0)
    assert len(model.calls) < 14  # stopped before decoding every window


@pytest.mark.parametrize("after", [0, 1])
def test_failing_helper_falls_back_to_the_root_with_one_warning(after, caplog):
    model = StandInVideoVAE()
    z = _latent(37)
    expected = _reference(model, z)
    model.fail_copies_after = after
    steps = []
    with caplog.at_level(logging.WARNING, logger="h3_multigpu"):
        out, report = _split(model, z, [(0, 3), (3, 5), (5, 7)], progress=steps.append)
    assert torch.equal(out, expected)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 2  # one per failed helper
    assert len(report.failed) == 1  # both helpers are the CPU here: one device name
    assert len(steps) == 7  # each window counted once
    # the helpers' windows were decoded (again) by the root's own module
    assert sum(1 for c in model.calls if c == id(model.decoder)) >= 3 + 4


# --- the decoding copy ---------------------------------------------------------------------------

def test_replica_copies_the_decoder_and_shares_the_encoder():
    model = StandInVideoVAE(dtype=torch.bfloat16)
    copy = make_replica(model, CPU)
    assert type(copy) is type(model) and copy.encoder is model.encoder
    for (name, p), (_, q) in zip(model.decoder.named_parameters(),
                                 copy.decoder.named_parameters(), strict=True):
        assert torch.equal(p, q) and p.dtype == q.dtype and p.data_ptr() != q.data_ptr(), name
        # as the original's (ComfyUI's VAE parameters require grad): ATen folds a batched
        # linear differently when the weight requires grad, even under inference mode
        assert q.requires_grad == p.requires_grad, name
    handle = copy.decoder.register_forward_pre_hook(lambda m, a: None)
    assert not model.decoder._forward_pre_hooks  # hook dicts are the copy's own
    handle.remove()


def test_replica_refuses_on_the_fly_weight_patches_and_instance_overrides():
    model = StandInVideoVAE()
    model.decoder.qkv.weight_function = [lambda w: w * 2]
    assert "patched while it runs" in check_replicable(model)
    model = StandInVideoVAE()
    model._decode_pixels = lambda z: z
    assert "replaced on this model" in check_replicable(model)
    model._decode_pixels = model.__class__._decode_pixels.__get__(model)  # restored by ComfyUI
    assert check_replicable(model) is None


def test_replica_refuses_dynamic_vram_managed_weights():
    model = StandInVideoVAE()
    model.decoder.qkv._v = object()  # what ComfyUI's DynamicVRAM load sets on a layer
    assert "managed by DynamicVRAM" in check_replicable(model)


def test_a_restored_method_on_the_model_does_not_make_a_helper_decode_with_the_roots():
    """ComfyUI leaves the class method bound to the model on the instance when it removes an
    object patch: a copy (or a view) must run its own modules, not the original's."""
    model = StandInVideoVAE()
    for name in ("tiled_decode", "_adaptive_decode", "_decode_pixels", "_finalize_pixels"):
        setattr(model, name, getattr(type(model), name).__get__(model))  # as ComfyUI restores
    assert check_replicable(model) is None
    assert "tiled_decode" not in vars(make_replica(model, CPU))
    z = _latent(17)
    expected = _reference(model, z)
    model.calls.clear()
    out, _ = _split(model, z, [(0, 1), (1, 3)])
    assert torch.equal(out, expected)
    assert len(set(model.calls)) == 2  # the helper's windows ran on the helper's decoder
    assert {"tiled_decode", "_adaptive_decode"} <= set(vars(model))  # the model is as it was


def test_split_needs_the_window_loop_and_names_the_missing_method():
    class NoChunks(StandInVideoVAE):
        _decode_temporal_chunks = None

    reason = check_splittable(NoChunks())
    assert reason.startswith("the VAE has no _decode_temporal_chunks method") and "0.33.0" in reason


class _ClippedLoop(StandInVideoVAE):
    """A window loop that skips finalising what falls past its output (the split cannot see
    the tail it needs for the cut): the decode must notice and run on the root instead."""

    def decode_temporal(self, z, output_buffer=None):
        out = output_buffer
        pad, count = self._decode_temporal_chunks(z.shape[2])
        if pad:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        pos, pending = 0, None
        for i in range(count):
            frames = self._adaptive_decode(z[:, :, 5 * i:5 * i + 7])
            head, tail = frames[:, :, 3:20], frames[:, :, 23:28]
            if pending is not None:
                head = self.blend(pending, head, self.frame_overlap, dim=-3)
            pending = tail
            for part in [head, tail] if i == count - 1 else [head]:
                n = min(part.shape[2], out.shape[2] - pos)
                if n > 0 and pos < out.shape[2] - 5:  # a tail at the end is "clipped"
                    out[:, :, pos:pos + n].copy_(self._finalize_pixels(part)[:, :, :n])
                elif n > 0:
                    out[:, :, pos:pos + n].copy_(part[:, :, :n].float().clamp(0, 1))
                pos += part.shape[2]
        return out


def test_a_window_loop_the_split_does_not_follow_decodes_on_the_root(caplog):
    model = _ClippedLoop()
    vae = FakeVAE(model)
    z = _latent(17)
    with torch.no_grad():
        expected = vae.decode(z)
    patched, _ = apply_multi_gpu_decode(vae, MultiGPUDecodeConfig(helpers=("cpu",)))
    with caplog.at_level(logging.WARNING, logger="h3_multigpu"), torch.no_grad():
        out = patched.decode(z)
    assert torch.equal(out, expected)
    patch = find_patch(patched)
    assert patch.split_calls == 0
    assert patch.last_line.startswith("one GPU: NOT ACTIVE for this VAE: the window loop wrote 5 "
                                      "frames past the cut at window 2")
    assert any("decoding on cpu alone" in r.getMessage() for r in caplog.records)


def test_config_names_the_helper_copy_choices():
    assert MultiGPUDecodeConfig(helper_copy=" Comfy ").helper_copy == "comfy"
    with pytest.raises(ValueError, match="helper_copy='clone': use 'auto', 'comfy'"):
        MultiGPUDecodeConfig(helper_copy="clone")


# --- the ComfyUI seam (object patch on decode_temporal) ------------------------------------------

def test_apply_patches_a_clone_and_the_vae_decode_is_bit_identical():
    model = StandInVideoVAE()
    vae = FakeVAE(model)
    z = _latent(37)
    with torch.no_grad():
        expected = vae.decode(z)
    patched, line = apply_multi_gpu_decode(
        vae, MultiGPUDecodeConfig(helpers=("cpu", "cpu"), shares=(1.0, 1.0, 0.5)))
    assert line.startswith("on: windows shared") and "exact" in line
    assert vae.patcher.object_patches == {}  # the loader's VAE is untouched
    patch = find_patch(patched)
    assert isinstance(patch, MultiGPUDecode)
    model.calls.clear()
    with torch.no_grad():
        out = patched.decode(z)
    assert torch.equal(out, expected)
    assert patch.split_calls == 1 and len(set(model.calls)) == 3
    assert "decoded on 3 device(s)" in patch.last_line
    assert "decode_temporal" not in vars(model)  # the object patch is gone after the call


def test_patch_stays_on_one_device_when_there_is_nothing_to_share():
    model = StandInVideoVAE()
    vae, _ = apply_multi_gpu_decode(FakeVAE(model), MultiGPUDecodeConfig(helpers=("cpu",)))
    z = _latent(7)  # one window
    with torch.no_grad():
        out = vae.decode(z)
    patch = find_patch(vae)
    assert patch.calls == 1 and patch.split_calls == 0
    assert patch.last_line == "one GPU: 1 window(s): nothing to share"
    assert torch.equal(out, FakeVAE(StandInVideoVAE()).decode(z))


def test_apply_refuses_a_vae_without_windows():
    class Plain:
        first_stage_model = torch.nn.Linear(2, 2)

    vae = Plain()
    same, line = apply_multi_gpu_decode(vae)
    assert same is vae and line.startswith("NOT ACTIVE")


def test_config_from_strings_checks_shares_against_devices():
    config = MultiGPUDecodeConfig.from_strings(helpers="gpu:0", shares="1:0.5")
    assert config.helpers == ("cuda:0",) and config.shares == (1.0, 0.5)
    with pytest.raises(ValueError, match="explicit helper list"):
        MultiGPUDecodeConfig.from_strings(helpers="auto", shares="1:1")


def test_dropin_carries_out_the_plans_decode_decision():
    from h3_multigpu.nodes.features import apply_decode_plan
    from h3_multigpu.planner import PlanRequest, plan_job

    vae = FakeVAE(StandInVideoVAE())
    same, line = apply_decode_plan(vae, None, 0)
    assert same is vae and line == "NOT ACTIVE: no plan"
    off = plan_job(PlanRequest(profile="2xH200", seconds=10, decode="off"))
    same, line = apply_decode_plan(vae, off, 0)
    assert same is vae and line == "off: one GPU (gpu:0): switched off"
    plan = plan_job(PlanRequest(profile="2xH200", seconds=10))
    patched, line = apply_decode_plan(vae, plan, 0)
    if torch.cuda.device_count() >= 2:
        assert find_patch(patched) is not None and line.startswith("on: ")
    else:  # the plan's gpu:1 is not on this machine: said, nothing patched
        assert patched is vae and line.startswith("NOT ACTIVE: helper device cuda:1")


@pytest.mark.parametrize("shares", ["inf:1", "1:inf", "1:0", "1:-2", "nan:1"])
def test_shares_that_are_not_positive_finite_speeds_are_refused(shares):
    """An infinite share divided a window's time by infinity (ZeroDivisionError mid-decode)."""
    with pytest.raises(ValueError, match=f"decode shares '{shares}' must all be positive and "
                                         "finite; write relative speeds like '1:0.7'"):
        MultiGPUDecodeConfig.from_strings(helpers="gpu:0", shares=shares)
    with pytest.raises(ValueError, match="must all be positive and finite"):
        MultiGPUDecodeConfig(helpers=("cpu",), shares=tuple(float(s) for s in shares.split(":")))
