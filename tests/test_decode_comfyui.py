"""The split video decode on ComfyUI's own H3 video VAE, through ComfyUI's `VAE.decode`.

Runs only with COMFYUI_PATH set to a ComfyUI checkout that has `comfy.ldm.minimax.vae` and the
H3 branch of `comfy.sd.VAE` (ComfyUI 0.33.0 and the newest files are the beds). The VAE is built
by ComfyUI from a state dict (its own detection), then made tiny with the upstream classes
themselves: a 2-block `ViT3DDecoder` and 64 px tiles with 16 px overlap, so the window loop, the
spatial tiles (and the tile batches where the release has them), the cross-fades and the
finalisation are the release's own at a size a CPU decodes in seconds. The reference is
ComfyUI's unpatched `VAE.decode`; ours is the same call on the patched clone.

dtypes: ComfyUI's own choice on this device (float32 on the CPU) and float16, the dtype it picks
for this VAE on a GPU (the VAE declares fp16 and fp32 as its working dtypes: never bf16). INT8:
the state dict carries a `comfy_quant` entry, so ComfyUI builds the VAE with
`ops.mixed_precision_ops`; the tiny decoder is built with that same Linear class and loaded
through its own `_load_from_state_dict` (int8 ConvRot weights -> comfy-kitchen QuantizedTensor).

On the CPU every "GPU" is the CPU (helpers "cpu"); with `multi_gpu` the VAE is on cuda:0 and
the helpers are the other GPUs.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from h3_checkpoints import INT8_CONVROT_CONF, comfy_quant_tensor, int8_weight, video_vae_state_dict

from h3_multigpu.decode import executor as executor_mod
from h3_multigpu.decode.apply import MultiGPUDecodeConfig, apply_multi_gpu_decode, find_patch
from h3_multigpu.decode.release import SHAPES
from h3_multigpu.decode.replica import SHARED_CHILDREN, make_replica, replica_bytes

pytestmark = pytest.mark.comfyui

FP16 = torch.float16


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
    torch.set_num_threads(max(2, torch.get_num_threads()))  # the standard: more than one thread
    return types.SimpleNamespace(sd=comfy.sd, h3_vae=h3_vae, ops=comfy.ops, mm=mm,
                                 utils=comfy.utils)


# --- tiny VAEs built by ComfyUI ----------------------------------------------------------------

QUANT_KEY = "decoder.transformer_blocks.0.attn.to_qkv.comfy_quant"


def _random(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * 0.2 + ("norm" in name)


def _int8_decoder(h3_vae, linear_cls, dtype, gen):
    """A 2-block decoder whose block Linears are ComfyUI's mixed-precision class, loaded from an
    int8 ConvRot state dict through that class's own loader (QuantizedTensor weights)."""
    with torch.device("meta"):
        layout = h3_vae.ViT3DDecoder(num_layers=2, heads=2, dim_head=128,
                                     operations=types.SimpleNamespace(Linear=torch.nn.Linear))
    quantized = {n for n, m in layout.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")}
    sd = {}
    for name, meta in layout.state_dict().items():
        value = _random(name, meta.shape, gen)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in quantized:
            sd[name], sd[f"{module}.weight_scale"] = int8_weight(value)
            sd[f"{module}.comfy_quant"] = comfy_quant_tensor(INT8_CONVROT_CONF)
        else:
            sd[name] = value.to(FP16)  # as the official file stores it
    decoder = h3_vae.ViT3DDecoder(num_layers=2, heads=2, dim_head=128,
                                  operations=types.SimpleNamespace(Linear=linear_cls))
    decoder.to(dtype)  # ComfyUI casts the model, then loads the file
    missing, unexpected = decoder.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return decoder, sd


def _tiny_vae(comfy, dtype=None, int8=False, seed=0, device=None):
    """ComfyUI's VAE from a state dict, its decoder then made tiny (see the module docstring).
    dtype None: ComfyUI's choice for this device; fp16 as it picks on a GPU."""
    # the two keys ComfyUI's VAE detection looks for (+ a comfy_quant entry: mixed precision)
    sd = {"decoder.transformer_blocks.0.scale1": torch.ones(2048),
          "encoder.down.5.block.0.conv1.weight": torch.zeros(1024, 512, 3, 3, 3)}
    if int8:
        sd[QUANT_KEY] = comfy_quant_tensor(INT8_CONVROT_CONF)
    vae = comfy.sd.VAE(sd=sd, device=device)
    model = vae.first_stage_model
    assert type(model).__name__ == "MiniMaxH3VideoVAE"
    if dtype is not None:  # what ComfyUI sets when it picks fp16 (casting the full-size
        vae.vae_dtype = dtype  # skeleton first would take 5 GB and half a minute on a CPU)
    gen = torch.Generator().manual_seed(seed)
    if int8:
        linear_cls = type(model.decoder.transformer_blocks[0].attn.to_qkv)
        assert "MixedPrecisionOps" in linear_cls.__qualname__, linear_cls
        model.decoder, file_sd = _int8_decoder(comfy.h3_vae, linear_cls, vae.vae_dtype, gen)
        vae.decoder_file = {f"decoder.{k}": v for k, v in file_sd.items()}  # for the tests
    else:
        model.decoder = comfy.h3_vae.ViT3DDecoder(num_layers=2, heads=2, dim_head=32,
                                                  operations=comfy.ops.disable_weight_init)
    model.tile_size, model.tile_overlap_min = 64, 16
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("decoder.") and int8:
                continue  # loaded above
            if not name.startswith("encoder."):
                p.copy_(_random(name, p.shape, gen))
    model.to(vae.vae_dtype)
    return vae


FACTORY_CALLS: list[tuple] = []


def _tiny_vae_patcher(comfy_path: str, dtype_name: str | None, int8: bool, seed: int):
    """A loader's reload factory (`cached_patcher_init`): the same tiny VAE, fresh, as
    `comfy.sd.load_vae_patcher` reloads a VAE file for ComfyUI's multi-GPU clones."""
    import comfy.ldm.minimax.vae as h3_vae
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    import comfy.utils

    FACTORY_CALLS.append((dtype_name, int8, seed))
    ns = types.SimpleNamespace(sd=comfy.sd, h3_vae=h3_vae, ops=comfy.ops, mm=mm,
                               utils=comfy.utils)
    dtype = getattr(torch, dtype_name) if dtype_name else None
    return _tiny_vae(ns, dtype=dtype, int8=int8, seed=seed).patcher


def _with_factory(vae, dtype=None, int8=False, seed=0):
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    vae.patcher.cached_patcher_init = (_tiny_vae_patcher,
                                       (os.environ["COMFYUI_PATH"], name, int8, seed))
    return vae


def _latent(t: int) -> torch.Tensor:
    # 6 x 7 latent cells = 96 x 112 px: 2 x 2 tiles of 64 px per window
    return torch.randn(1, 24, t, 6, 7, generator=torch.Generator().manual_seed(t))


def _config(helpers: int, shares=None, **kwargs) -> MultiGPUDecodeConfig:
    if torch.cuda.device_count() >= 2:  # the VAE's GPU and every other GPU, equal shares
        return MultiGPUDecodeConfig(**kwargs)
    return MultiGPUDecodeConfig(helpers=("cpu",) * helpers, shares=shares, **kwargs)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _run_split(comfy, t, helpers, shares=None, dtype=None, int8=False, **config):
    vae = _tiny_vae(comfy, dtype=dtype, int8=int8)
    if config.get("helper_copy") == "comfy":
        _with_factory(vae, dtype, int8)
    z = _latent(t)
    expected = vae.decode(z)
    assert expected.isfinite().all()  # a meaningful reference
    patched, line = apply_multi_gpu_decode(vae, _config(helpers, shares, **config))
    assert line.startswith("on: "), line
    patch = find_patch(patched)
    out = patched.decode(z)
    return expected, out, patch, line


def _check_split(patch, expected, out, devices: int | None = None):
    assert _same_bits(out, expected)
    assert patch.split_calls == 1 and patch.last_report is not None
    report = patch.last_report
    used = [r for r in report.windows if r[1] > r[0]]
    assert len(used) >= 2 and report.handovers == len(used) - 1  # one cross-fade per cut
    assert report.same_tile_batches, report.tile_batches
    assert len(report.tile_batches) == used[-1][1]  # every window went through a range
    if devices is not None:
        assert len(used) == devices


# --- bit identity -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [None, FP16], ids=["comfy-dtype", "fp16"])
@pytest.mark.parametrize("t,helpers,shares", [
    (12, 1, None),  # 2 windows
    (17, 2, None),  # 3 windows, 3 devices
    (22, 1, (1.0, 2.0)),  # 4 windows, uneven
    (10, 1, None),  # padded like the model
])
def test_comfyui_vae_decode_split_is_bit_identical(comfy, t, helpers, shares, dtype):
    expected, out, patch, _ = _run_split(comfy, t, helpers, shares, dtype=dtype)
    _check_split(patch, expected, out)


@pytest.mark.parametrize("dtype", [None, FP16], ids=["comfy-dtype", "fp16"])
@pytest.mark.parametrize("helper_copy", ["copy", "comfy"])
def test_comfyui_int8_convrot_vae_decode_split_is_bit_identical(comfy, dtype, helper_copy):
    """The INT8 ConvRot video VAE: decoder Linears hold comfy-kitchen QuantizedTensors.

    Under inference mode, as ComfyUI's executor runs VAE Decode: comfy-kitchen caches its
    rotation matrices, and one cached by an earlier inference-mode call cannot enter a graph
    recorded for autograd (the loaded weights require grad), unpatched or split alike."""
    with torch.inference_mode():
        expected, out, patch, _ = _run_split(comfy, 17, 2, dtype=dtype, int8=True,
                                             helper_copy=helper_copy)
    _check_split(patch, expected, out, devices=3)
    copies = patch.last_report.copy_seconds
    assert (copies == {} and all(h.patcher is not None for h in patch.helpers)) \
        if helper_copy == "comfy" else set(copies) == {"cpu"}
    weight = patch.model.decoder.transformer_blocks[0].attn.to_qkv.weight
    assert type(weight).__name__ == "QuantizedTensor" and weight._qdata.dtype == torch.int8


def test_comfyui_status_line_names_the_release_shape(comfy):
    vae = _tiny_vae(comfy)
    _, line = apply_multi_gpu_decode(vae, _config(1))
    newest = callable(getattr(type(vae.first_stage_model), "_decode_tile_row", None))
    assert SHAPES["newest" if newest else "0.33.0"] in line, line
    assert "each GPU runs the VAE's own decode_temporal" in line
    assert "helper decoder: a copy of the root's loaded decoder (DynamicVRAM off)" in line


def test_comfyui_vae_decode_split_under_inference_mode(comfy):
    """ComfyUI executes every node under inference mode: its preallocated output is then an
    inference tensor, which the worker threads (started outside that mode) must still fill."""
    with torch.inference_mode():
        expected, out, patch, _ = _run_split(comfy, 17, 2)
    _check_split(patch, expected, out, devices=3)


# --- helpers from ComfyUI's multi-GPU clones (DynamicVRAM's path) ------------------------------

def test_comfyui_helper_from_comfys_multi_gpu_clone_is_bit_identical(comfy):
    """helper_copy='comfy': each helper decodes with ComfyUI's own deepclone_multigpu of the
    VAE (reloaded by the loader's factory, loaded by ComfyUI), not a copy of the root's."""
    FACTORY_CALLS.clear()
    expected, out, patch, line = _run_split(comfy, 22, 2, helper_copy="comfy")
    assert "helper decoder: ComfyUI's multi-GPU clone (deepclone_multigpu)" in line, line
    assert len(FACTORY_CALLS) == len(patch.helpers) == 2  # one reload per helper, by core
    _check_split(patch, expected, out, devices=3)
    clones = [h.patcher.model for h in patch.helpers]
    assert all(c is not patch.model and c.decoder is not patch.model.decoder for c in clones)
    assert patch.last_report.copy_seconds == {}  # nothing copied by the pack


def test_comfyui_under_dynamic_vram_the_helper_must_be_comfys_clone(comfy):
    """DynamicVRAM cannot run on a CPU: the root patcher answers is_dynamic() as
    ModelPatcherDynamic does. Without a reload factory there is no core path: refused, saying
    why; a copy is refused too; with the factory the helper is ComfyUI's clone."""
    vae = _tiny_vae(comfy)
    vae.patcher.is_dynamic = lambda: True
    same, line = apply_multi_gpu_decode(vae, _config(1))
    assert same is vae
    assert line == ("NOT ACTIVE: under DynamicVRAM a helper's decoder must be ComfyUI's "
                    "multi-GPU clone, and this VAE's loader registered no reload factory "
                    "(cached_patcher_init), so ComfyUI cannot clone it for another GPU: load "
                    "it with Load VAE (VAELoader) or a checkpoint loader")
    same, line = apply_multi_gpu_decode(vae, _config(1, helper_copy="copy"))
    assert same is vae and line.startswith("NOT ACTIVE: helper_copy='copy' under DynamicVRAM")
    _with_factory(vae)
    z = _latent(12)
    expected = vae.decode(z)
    patched, line = apply_multi_gpu_decode(vae, _config(1))
    assert "helper decoder: ComfyUI's multi-GPU clone (deepclone_multigpu), loaded on the " \
           "helper by ComfyUI under DynamicVRAM" in line, line
    patch = find_patch(patched)
    _check_split(patch, expected, patched.decode(z), devices=2)


# --- INT8 weights: what a helper's copy really holds ------------------------------------------

def _expected_copy_bytes(model, file_sd: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes a decoding copy holds, the same counted at the weights' logical dtype): an INT8
    weight is the file's int8 tensor and its scale; everything else as loaded."""
    real = logical = 0
    for name, module in model.named_modules():
        if name.split(".")[0] in SHARED_CHILDREN:
            continue
        for key, t in (*module._parameters.items(), *module._buffers.items()):
            if t is None:
                continue
            logical += t.numel() * t.element_size()
            if type(t).__name__ == "QuantizedTensor":
                real += file_sd[f"{name}.{key}"].nbytes + file_sd[f"{name}.{key}_scale"].nbytes
            else:
                real += t.numel() * t.element_size()
    return real, logical


@pytest.mark.slow
def test_comfyui_replica_size_of_the_full_int8_convrot_vae_is_its_real_size(comfy):
    """The full-size INT8 ConvRot video VAE through ComfyUI's VAE loader (2.4 GB of int8
    decoder weights; about 2 minutes and 4 GB of RAM on a CPU to draw and load)."""
    sd = video_vae_state_dict("int8_convrot")
    vae = comfy.sd.VAE(sd=sd)
    model = vae.first_stage_model
    weight = model.decoder.transformer_blocks[0].attn.to_qkv.weight
    assert type(weight).__name__ == "QuantizedTensor" and weight._qdata.dtype == torch.int8
    real, logical = _expected_copy_bytes(model, sd)
    assert replica_bytes(model) == real
    assert real < 0.55 * logical  # int8 counted at fp16 size was twice the real copy


def test_comfyui_int8_replica_holds_quantized_weights_at_their_real_size(comfy):
    vae = _tiny_vae(comfy, int8=True)
    model = vae.first_stage_model
    real, logical = _expected_copy_bytes(model, vae.decoder_file)
    assert replica_bytes(model) == real < logical
    copy = make_replica(model, torch.device("cpu"))
    w, c = (m.decoder.transformer_blocks[1].ff.w2.weight for m in (model, copy))
    assert type(c).__name__ == "QuantizedTensor" and c._qdata.dtype == torch.int8
    assert torch.equal(c._qdata, w._qdata) and c._qdata.data_ptr() != w._qdata.data_ptr()
    assert torch.equal(c._params.scale, w._params.scale)
    assert replica_bytes(copy) == real


# --- progress, interrupt, failure ------------------------------------------------------------

def test_comfyui_progress_bar_and_interrupt(comfy, monkeypatch):
    vae = _tiny_vae(comfy)
    patched, _ = apply_multi_gpu_decode(vae, _config(1))
    updates, shown = [], []
    update = comfy.utils.ProgressBar.update
    monkeypatch.setattr(comfy.utils.ProgressBar, "update",
                        lambda self, value: (updates.append(value), update(self, value)))
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None:
                                             shown.append((value, total)))
    try:
        patched.decode(_latent(17))
        assert updates == [1, 1, 1]  # one step per window
        assert shown[-1] == (3, 3)  # what ComfyUI shows (it throttles the steps between)
        comfy.mm.interrupt_current_processing(True)
        with pytest.raises(comfy.mm.InterruptProcessingException):
            patched.decode(_latent(17))
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
        comfy.mm.interrupt_current_processing(False)


def test_comfyui_failing_helper_falls_back_to_the_root(comfy, monkeypatch, caplog):
    """A helper whose decoder raises mid-range: its windows are decoded again on the root by
    the VAE's own loop, with one warning, and the video is still bit-identical."""
    real = executor_mod.make_replica

    def failing_replica(model, device, move):
        replica = real(model, device, move)
        calls = []

        def fail(module, args):
            calls.append(1)
            if len(calls) > 1:  # mid-way through the helper's first window
                raise RuntimeError("simulated helper failure")

        replica.decoder.register_forward_pre_hook(fail)
        return replica

    monkeypatch.setattr(executor_mod, "make_replica", failing_replica)
    vae = _tiny_vae(comfy)
    z = _latent(22)
    expected = vae.decode(z)
    patched, _ = apply_multi_gpu_decode(vae, MultiGPUDecodeConfig(helpers=("cpu",)))
    with caplog.at_level("WARNING", logger="h3_multigpu"):
        out = patched.decode(z)
    assert _same_bits(out, expected)
    report = find_patch(patched).last_report
    assert "cpu" in report.failed and "simulated helper failure" in report.failed["cpu"]
    assert sum("failed" in r.getMessage() for r in caplog.records) == 1
    assert "its windows redone on the root" in find_patch(patched).last_line


@pytest.mark.multi_gpu
@pytest.mark.parametrize("helper_copy", ["copy", "comfy"])
def test_comfyui_vae_decode_split_on_gpus_is_bit_identical(comfy, helper_copy):
    assert torch.cuda.device_count() >= 2
    with torch.inference_mode():  # as ComfyUI executes the node
        expected, out, patch, _ = _run_split(comfy, 22, 1, helper_copy=helper_copy)
    _check_split(patch, expected, out)
    assert any(d.startswith("cuda:1") for d in patch.last_report.devices)


@pytest.mark.multi_gpu
def test_comfyui_int8_vae_decode_split_on_gpus_is_bit_identical(comfy):
    with torch.inference_mode():
        expected, out, patch, _ = _run_split(comfy, 22, 1, int8=True)
    _check_split(patch, expected, out)
