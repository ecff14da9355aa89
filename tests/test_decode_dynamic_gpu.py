"""The split video decode under DynamicVRAM (ModelPatcherDynamic, comfy-aimdo) on real GPUs.

Under DynamicVRAM the VAE's weights stay on the host and each layer is cast into the patcher's
VBAR at op time, so a helper's decoder must be ComfyUI's own multi-GPU clone
(`deepclone_multigpu`, loaded by ComfyUI on the helper), never a module-by-module copy. The VAE
is the full-size fp16 file, loaded by ComfyUI's own Load VAE node (which registers the reload
factory the clone needs); the reference is ComfyUI's unpatched `VAE.decode`.

The split must equal that reference bit for bit where ComfyUI's own decode is reproducible.
Under DynamicVRAM it is not always: on one H100 80GB HBM3 (torch 2.11.0+cu130, cuDNN 9.19) the
first VAE.decode of the process differed from every later one in the first window's frames (0-21
of 73: up to 0.0016 in [0, 1] pixels, about one fp16 step of the decoder), with nothing patched;
the difference starts at the first attention call (the post-quant conv, the linears before it,
RMSNorm and RoPE were equal). Every later decode, warm or first after ComfyUI unloaded
everything, on the root or on the clone, with 3 to 12 GiB left free, was equal bit for bit, and
so was the split (on the H200 the first decode was equal too). So each test decodes the same
latent unpatched several times, on the root and on each helper's clone (the process's or the
GPU's first decode among them, the first after ComfyUI unloaded everything, and warm ones), and
the split must equal one of ComfyUI's own decodes bit for bit (where they all agree: all of
them); their spread must stay about an fp16 step (`MAX_SPREAD`), else ComfyUI's own decode is
not reproducible on that machine and the test says so. A wrong window, cut or cross-fade equals
none of them.

On one GPU the helper is a second clone on the same GPU (proves the plumbing: the clone, its
load by ComfyUI, its own VBAR, the cut and the cross-fade); on two GPUs the patch is applied as
a user applies it. DynamicVRAM must be switched on before `comfy.model_management` is imported,
as ComfyUI's main.py does, so run this file in a pytest process of its own:

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -m "gpu or multi_gpu" \
        -o addopts="--strict-markers" -p no:cacheprovider -rfs tests/test_decode_dynamic_gpu.py
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from h3_multigpu.comfy_seam.memory import is_dynamic
from h3_multigpu.decode.apply import (
    Helper,
    MultiGPUDecode,
    MultiGPUDecodeConfig,
    apply_multi_gpu_decode,
    find_patch,
    install,
)
from h3_multigpu.decode.replica import CloneMissing, check_replicable, comfy_clone

pytestmark = pytest.mark.comfyui

VAE_NAME = "minimax_h3_video_vae_fp16.safetensors"
# ComfyUI's own unpatched decodes of one latent may differ in the last bits (see the docstring),
# by this much at most: pixels are in [0, 1]; one fp16 step of the raw decoder
# output near 1 is 2^-10, ~0.0002 after the (x * 0.229 + 0.485) of _finalize_pixels; the H100
# measured 0.0016 (a step of a larger activation carried through the window)
MAX_SPREAD = 0.01


def _enable_dynamic_vram():
    """What ComfyUI 0.33.0's main.py does at start (the harness's enable_dynamic_vram)."""
    from comfyui_h3 import ComfyUIUnavailable, enable_dynamic_vram

    try:
        enable_dynamic_vram()
    except ComfyUIUnavailable as exc:
        pytest.skip(f"DynamicVRAM is off in this session (run it with H3_DYNAMIC_VRAM=1): {exc}")


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("DynamicVRAM needs a CUDA GPU")
    memory = sys.modules.get("comfy.memory_management")
    if "comfy.model_management" in sys.modules and not getattr(memory, "aimdo_enabled", False):
        pytest.skip("run this file in its own pytest process, or the session with "
                    "H3_DYNAMIC_VRAM=1: DynamicVRAM must be switched on before "
                    "comfy.model_management is imported")
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    _enable_dynamic_vram()
    import folder_paths
    from h3_checkpoints import write_video_vae

    import nodes  # ComfyUI's own nodes.py (its Load VAE node), not this pack's

    folder = tmp_path_factory.mktemp("vae")
    write_video_vae(folder / VAE_NAME, "fp16", device="cuda")  # the full-size file, 5 GB
    folder_paths.add_model_folder_path("vae", str(folder))
    (vae,) = nodes.VAELoader().load_vae(VAE_NAME)  # ComfyUI's own Load VAE node
    assert is_dynamic(vae.patcher), type(vae.patcher).__name__
    return vae


def _needs_factory(vae) -> None:
    if vae.patcher.cached_patcher_init is None:  # 0.3.64's nodes.py (the newest-files bed)
        pytest.skip("this ComfyUI's Load VAE registers no reload factory (cached_patcher_init); "
                    "test_dynamic_vram_without_a_reload_factory_says_why covers it")


def _latent(t: int) -> torch.Tensor:
    # 8 x 10 latent cells = 128 x 160 px: one 256 px tile per window
    return torch.randn(1, 24, t, 8, 10, generator=torch.Generator().manual_seed(t))


def _on_clone(vae, patcher):
    """The VAE wrapper decoding with ComfyUI's clone `patcher`, as Select VAE Device makes it."""
    other = copy.copy(vae)
    other.patcher = patcher
    other.first_stage_model = patcher.model
    other.device = patcher.load_device
    return other


def _comfys_own_decodes(vaes, z: torch.Tensor) -> list[torch.Tensor]:
    """ComfyUI's unpatched VAE.decode of `z` on each wrapper: the first right after ComfyUI
    unloaded everything (every weight faulted into the VBAR as it runs), then a warm one."""
    from comfyui_h3 import unload_all

    out = []
    for vae in vaes:
        unload_all()
        with torch.inference_mode():
            out += [vae.decode(z), vae.decode(z)]
    return out


def _assert_matches_comfys_own(out: torch.Tensor, expected: torch.Tensor,
                               references: list[torch.Tensor], line: str = "") -> None:
    """`out` (the split) equals one of ComfyUI's own unpatched decodes (`references`, `expected`
    = VAE.decode first among them) bit for bit, and those differ by MAX_SPREAD at most."""
    assert out.isfinite().all() and out.shape == expected.shape, line
    spread = max((a.float() - b.float()).abs().max().item()
                 for a in references for b in references)
    error = (out.float() - expected.float()).abs().max().item()
    equal = sum(torch.equal(out, r) for r in references)
    why = (f"split vs VAE.decode: max |difference| {error:.3g}; the split equals {equal} of "
           f"ComfyUI's own {len(references)} unpatched decodes of this latent (on the root and "
           f"the helper's clone, first after a load and warm), which differ among themselves by "
           f"up to {spread:.3g}. {line}")
    assert spread <= MAX_SPREAD, "ComfyUI's own decode is not reproducible here: " + why
    assert equal > 0, why


@pytest.mark.gpu
def test_dynamic_vram_helper_is_comfys_clone_and_the_decode_matches_comfys_own(dynamic):
    vae, gpu = dynamic, torch.device("cuda", 0)
    _needs_factory(vae)
    z = _latent(22)  # 4 windows
    with torch.inference_mode():
        expected = vae.decode(z)
        again = vae.decode(z)
    root = vae.first_stage_model
    assert check_replicable(root) is not None  # loaded under DynamicVRAM: never copied
    helper = Helper(gpu, comfy_clone(vae.patcher, gpu))
    assert is_dynamic(helper.patcher) and helper.patcher.model is not root
    patch = MultiGPUDecode(root, MultiGPUDecodeConfig(helpers=("cuda:0",)), [helper],
                           vae.memory_used_decode)
    patched = install(vae, patch)
    with torch.inference_mode():
        out = patched.decode(z)
    report, line = patch.last_report, patch.last_line
    assert patch.split_calls == 1 and report.devices == ["cuda:0", "cuda:0"], line
    assert report.copy_seconds == {} and report.handovers == 1 and report.same_tile_batches
    # the helper decoded with ComfyUI's clone: its own VBAR, weights still on the host
    linear = helper.patcher.model.decoder.transformer_blocks[0].attn.to_qkv
    assert hasattr(linear, "_v") and linear.weight.device.type == "cpu"
    assert linear is not root.decoder.transformer_blocks[0].attn.to_qkv
    references = [expected, again, *_comfys_own_decodes(
        [vae, _on_clone(vae, helper.patcher)], z)]
    _assert_matches_comfys_own(out, expected, references, line)


@pytest.mark.gpu
def test_dynamic_vram_refuses_a_copy_of_vbar_managed_weights(dynamic):
    config = MultiGPUDecodeConfig(helpers=(), helper_copy="copy")
    same, line = apply_multi_gpu_decode(dynamic, config)
    assert same is dynamic
    assert line.startswith("NOT ACTIVE: helper_copy='copy' under DynamicVRAM"), line


@pytest.mark.gpu
def test_dynamic_vram_without_a_reload_factory_says_why(dynamic):
    """The core path the helper needs, refused in words (apply_multi_gpu_decode puts them in
    its NOT ACTIVE line: tests/test_decode_comfyui.py checks that line on the CPU)."""
    factory = dynamic.patcher.cached_patcher_init
    dynamic.patcher.cached_patcher_init = None
    try:
        with pytest.raises(CloneMissing, match="registered no reload factory"):
            comfy_clone(dynamic.patcher, torch.device("cuda", 0))
    finally:
        dynamic.patcher.cached_patcher_init = factory


@pytest.mark.multi_gpu
def test_dynamic_vram_split_on_gpus_matches_comfys_own(dynamic):
    assert torch.cuda.device_count() >= 2
    _needs_factory(dynamic)
    z = _latent(37)  # 7 windows
    with torch.inference_mode():
        expected = dynamic.decode(z)
        again = dynamic.decode(z)
    patched, line = apply_multi_gpu_decode(dynamic, MultiGPUDecodeConfig())
    assert "helper decoder: ComfyUI's multi-GPU clone (deepclone_multigpu), loaded on the " \
           "helper by ComfyUI under DynamicVRAM" in line, line
    patch = find_patch(patched)
    clones = [_on_clone(dynamic, h.patcher) for h in patch.helpers]
    with torch.inference_mode():
        # ComfyUI's own first decode on each helper GPU (a first decode may differ, see above)
        firsts = [clone.decode(z) for clone in clones]
        out = patched.decode(z)
    assert patch.split_calls == 1 and any(d.startswith("cuda:1") for d in
                                          patch.last_report.devices), patch.last_line
    references = [expected, again, *firsts, *_comfys_own_decodes([dynamic, *clones], z)]
    _assert_matches_comfys_own(out, expected, references, patch.last_line)
