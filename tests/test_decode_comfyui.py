"""The split video decode on ComfyUI's own H3 video VAE, through ComfyUI's `VAE.decode`.

Runs only with COMFYUI_PATH set to a ComfyUI checkout that has `comfy.ldm.minimax.vae` and the
H3 branch of `comfy.sd.VAE`. The VAE is built by ComfyUI from a state dict (its own detection),
then made tiny with the upstream classes themselves: a 2-block, 64-wide `ViT3DDecoder` and
64 px tiles with 16 px overlap, so the window loop, the spatial tiles, the tile batches and the
cross-fades are the real ones at a size a CPU decodes in seconds. The reference is ComfyUI's
unpatched `VAE.decode`; ours is the same call on the patched clone.

On the CPU every "GPU" is the CPU (helpers "cpu"); with `multi_gpu` the VAE is on cuda:0 and
the helpers are the other GPUs, in the VAE's dtype.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from h3_multigpu.decode.apply import MultiGPUDecodeConfig, apply_multi_gpu_decode, find_patch

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy():
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    try:
        import comfy.cli_args

        if not torch.cuda.is_available():  # as `main.py --cpu`: no GPU probing at import
            comfy.cli_args.args.cpu = True
        import comfy.model_management as mm
        import comfy.ops
        import comfy.sd
        import comfy.utils
        from comfy.ldm.minimax import vae as h3_vae
    except ImportError as exc:
        pytest.skip(f"ComfyUI's H3 video VAE cannot be imported in this Python: {exc}")
    return comfy.sd, h3_vae, comfy.ops, mm, comfy.utils


def _tiny_vae(comfy, device=None):
    sd_mod, h3_vae, ops, _, _ = comfy
    # the two keys ComfyUI's VAE detection looks for; everything else is set below
    sd = {"decoder.transformer_blocks.0.scale1": torch.ones(2048),
          "encoder.down.5.block.0.conv1.weight": torch.zeros(1024, 512, 3, 3, 3)}
    vae = sd_mod.VAE(sd=sd, device=device)
    model = vae.first_stage_model
    assert type(model).__name__ == "MiniMaxH3VideoVAE"
    model.decoder = h3_vae.ViT3DDecoder(num_layers=2, heads=2, dim_head=32,
                                        operations=ops.disable_weight_init)
    model.tile_size, model.tile_overlap_min = 64, 16
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("encoder."):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + ("norm" in name))
    model.to(vae.vae_dtype)
    return vae


def _latent(t: int) -> torch.Tensor:
    # 6 x 7 latent cells = 96 x 112 px: 2 x 2 tiles of 64 px per window
    return torch.randn(1, 24, t, 6, 7, generator=torch.Generator().manual_seed(t))


def _config(helpers: int, shares=None) -> MultiGPUDecodeConfig:
    if torch.cuda.device_count() >= 2:  # the VAE's GPU and every other GPU, equal shares
        return MultiGPUDecodeConfig()
    return MultiGPUDecodeConfig(helpers=("cpu",) * helpers, shares=shares)


def _run_split(comfy, t, helpers, shares=None):
    vae = _tiny_vae(comfy)
    z = _latent(t)
    expected = vae.decode(z)
    patched, line = apply_multi_gpu_decode(vae, _config(helpers, shares))
    assert line.startswith("on: "), line
    patch = find_patch(patched)
    out = patched.decode(z)
    return expected, out, patch


@pytest.mark.parametrize("t,helpers,shares", [
    (12, 1, None),  # 2 windows
    (17, 2, None),  # 3 windows, 3 devices
    (22, 1, (1.0, 2.0)),  # 4 windows, uneven
    (10, 1, None),  # padded like the model
])
def test_comfyui_vae_decode_split_is_bit_identical(comfy, t, helpers, shares):
    expected, out, patch = _run_split(comfy, t, helpers, shares)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.equal(out, expected)
    assert patch.split_calls == 1 and patch.last_report is not None
    report = patch.last_report
    used = [r for r in report.windows if r[1] > r[0]]
    assert len(used) >= 2 and report.handovers == len(used) - 1
    assert report.same_tile_batches, report.tile_batches


def test_comfyui_vae_decode_split_under_inference_mode(comfy):
    """ComfyUI executes every node under inference mode: its preallocated output is then an
    inference tensor, which the writer threads (started outside that mode) must still fill."""
    with torch.inference_mode():
        expected, out, patch = _run_split(comfy, 17, 2)
    assert torch.equal(out, expected)
    assert patch.split_calls == 1 and len(patch.last_report.devices) == 3


@pytest.mark.multi_gpu
def test_comfyui_vae_decode_split_on_gpus_is_bit_identical(comfy):
    assert torch.cuda.device_count() >= 2
    with torch.inference_mode():  # as ComfyUI executes the node
        expected, out, patch = _run_split(comfy, 22, 1)
    assert torch.equal(out, expected)
    assert any(d.startswith("cuda:1") for d in patch.last_report.devices)


def test_comfyui_progress_bar_and_interrupt(comfy):
    _, _, _, mm, utils = comfy
    vae = _tiny_vae(comfy)
    patched, _ = apply_multi_gpu_decode(vae, _config(1))
    steps = []
    utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None:
                                       steps.append((value, total)))
    try:
        patched.decode(_latent(17))
        assert steps[-1] == (3, 3) and len(steps) == 3
        mm.interrupt_current_processing(True)
        with pytest.raises(mm.InterruptProcessingException):
            patched.decode(_latent(17))
    finally:
        utils.set_progress_bar_global_hook(None)
        mm.interrupt_current_processing(False)
