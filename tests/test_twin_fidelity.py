"""The twin against ComfyUI's real H3 classes: one state dict, bit-identical whole forward.

Runs with COMFYUI_PATH set to a ComfyUI tree that has `comfy/ldm/minimax/model.py`: ComfyUI
0.33.0, or the newest upstream H3 files laid over ComfyUI 0.3.64. Upstream side: `comfy.model_base.
MiniMaxH3` built from `comfy.supported_models.MiniMaxH3` (its `extra_conds` refines the text,
builds the payload and the layout), its `diffusion_model` called as the sampler calls it.
Twin side: `make_twin` + `make_conditioning` with the same state dict and inputs.

The twin is the newest files' H3. Against an older release it follows that release where every
forward depends on it (`TwinConfig.sigma_math`: 0.33.0 shifts the sigma in fp32), and the tests
compare only what that release has (`Release` below, feature-detected): on 0.33.0 the DiT takes
no denoise masks (its sampler applies them outside the model), block patches get no `layout` and
cannot hand the block an `attention`, and no module has a `ComfyAttention`; those cases skip
with the reason.

Both sides run the same attention function: the twin's module is pointed at ComfyUI's
`optimized_attention` and container (the twin's own dispatch mirrors ComfyUI's, but ComfyUI's
CPU default kernel is sub-quadratic attention, not the twin's SDPA), so a difference can only
come from the rest of the forward. Equality is exact (`torch.equal`) in fp32 and bf16 on CPU:
both sides run the same kernels in the same order on the same inputs, whatever the thread count.
Every case also checks that its feature changed the output, so a case cannot pass by being
ignored on both sides.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
import twin.model as twin_layers
from comfyui_h3 import import_comfyui_or_skip
from twin import (
    TwinConfig,
    attention_config_tensor,
    comfyui_attention,
    make_conditioning,
    make_twin,
)

pytestmark = pytest.mark.comfyui

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADALN = {"pruned": TwinConfig.tiny(), "full": TwinConfig.tiny(adaln_grid=None, t_dim=24)}
# on a GPU: upstream's 128-wide heads and 3 x 16 rotary frequencies, two blocks
GPU_CONFIG = TwinConfig.tiny(hidden=512, heads=4, head_dim=128, ffn=1024, blocks=2,
                             text_dim=256, t_dim=64, adaln_grid=64, rope_freqs_per_axis=16)
SHAPE = {"latent_t": 3, "latent_h": 4, "latent_w": 6, "audio_t": 5}


@dataclass(frozen=True)
class Release:
    """What this ComfyUI's H3 forward has, feature-detected (checked on 0.33.0 and the newest
    files): the twin follows `sigma_math`; a case needing a feature the release lacks skips."""

    sigma_math: str  # "float": the newest files; "fp32": 0.33.0 (`TwinConfig.sigma_math`)
    forward_masks: bool  # the DiT forward takes denoise_mask / audio_denoise_mask (per-row t)
    patch_layout: bool  # block replace patches get args["layout"]
    patch_attention: bool  # a patch may hand the block its own `attention`
    comfy_attention: bool  # per-module ComfyAttention (a checkpoint's comfy_attention.config)

    @classmethod
    def detect(cls, h3, attention) -> Release:
        forward = inspect.getsource(h3.MiniMaxH3Model._forward)
        return cls(
            # the newest files turn the sigma into a Python float before shifting it
            sigma_math="float" if re.search(r"sigma_v\s*=\s*float\(", forward) else "fp32",
            forward_masks="audio_denoise_mask" in inspect.signature(
                h3.MiniMaxH3Model._forward).parameters,
            patch_layout=re.search(r'"layout":\s*layout', forward) is not None,
            patch_attention="attention" in inspect.signature(h3.DiTBlock.forward).parameters,
            comfy_attention=hasattr(attention, "ComfyAttention"))

    def skip_without(self, feature: str, why: str) -> None:
        if not getattr(self, feature):
            pytest.skip(f"this ComfyUI's H3 has no {why}: nothing of it to compare")


@pytest.fixture(scope="module")
def comfy():
    package = import_comfyui_or_skip()  # the shared harness: $COMFYUI_PATH, --cpu without CUDA
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention
    import comfy.utils

    return SimpleNamespace(h3=h3, attention=attention, ops=package.ops,
                           supported=package.supported_models, utils=comfy.utils,
                           release=Release.detect(h3, attention))


@pytest.fixture(autouse=True)
def same_attention(comfy):
    with comfyui_attention(comfy.attention):
        assert twin_layers.optimized_attention is comfy.attention.optimized_attention
        yield


_PAIRS: dict = {}


def pair(comfy, adaln: str, dtype_name: str, device: str = "cpu"):
    """(twin, ComfyUI's MiniMaxH3 base model) with one state dict, cached per config."""
    key = (adaln, dtype_name, device)
    if key not in _PAIRS:
        cfg, dtype = GPU_CONFIG if adaln == "gpu" else ADALN[adaln], DTYPES[dtype_name]
        cfg = replace(cfg, sigma_math=comfy.release.sigma_math)
        twin = make_twin(cfg, dtype=dtype, seed=3)
        model_config = comfy.supported.MiniMaxH3(dict(cfg.upstream_kwargs(),
                                                      image_model="minimax_h3"))
        model_config.set_inference_dtype(dtype, None)
        base = model_config.get_model({}, device="cpu")
        base.diffusion_model.load_state_dict(twin.state_dict(), strict=True)
        base.diffusion_model.requires_grad_(False).eval().to(device)
        _PAIRS[key] = (twin.to(device), base)
    return _PAIRS[key]


def inputs(cfg: TwinConfig, dtype, seed=1, latent_h=4, latent_w=6, device="cpu", shape=None):
    shape = dict(SHAPE if shape is None else shape)
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn(1, cfg.latents_dim, shape["latent_t"], latent_h, latent_w, generator=gen)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, shape["audio_t"], generator=gen)
    context = torch.randn(1, 16, cfg.text_dim, generator=gen).to(dtype)
    return ([video.to(device), audio.to(device)], torch.tensor([700.0], device=device),
            context.to(device))


def conditions(cfg: TwinConfig):
    gen = torch.Generator().manual_seed(7)

    def video(t, h=4, w=6):
        return torch.randn(1, cfg.latents_dim, t, h, w, generator=gen)

    def audio(t):
        return torch.randn(1, cfg.audio_latents_dim, 2, t, generator=gen)

    audio_mask = torch.ones(1, cfg.audio_latents_dim, 2, SHAPE["audio_t"])
    audio_mask[..., 1:3] = 0.25
    audio_mask[:, 3, 1, 4] = 0.5  # pooled over channels: one more row level
    return {
        "keyframes": {"keyframes": [
            {"resolved_frame_index": 0, "latent": video(1)},
            {"resolved_frame_index": 8, "latent": video(1), "audio_latent": audio(3)}]},
        "references": {"refs": [
            {"kind": "image", "latent_h": 2, "latent_w": 4, "latent": video(1, 2, 4)},
            {"kind": "audio", "ref_audio_t": 3, "audio_latent": audio(3)},
            {"kind": "video_audio", "latent_h": 4, "latent_w": 2, "latent_t": 2,
             "ref_audio_t": 4, "latent": video(2, 4, 2), "audio_latent": audio(4)}]},
        "noise_aug": {"keyframes": [{"resolved_frame_index": 4, "latent": video(1)}],
                      "visual_cond_noise_aug": 0.9, "seed": 5},
        "text_tags": {"text_token_tags": torch.tensor([1] * 5 + [0] * 4 + [1] * 7)},
        "audio_mask": {"masks": (torch.ones(1, cfg.latents_dim, 3, 4, 6), audio_mask)},
    }


def upstream_conds(comfy, base, x, context, case: dict) -> dict:
    """What ComfyUI's sampler passes the diffusion model: extra_conds of the real model class."""
    shapes = [x[0].shape, x[1].shape]
    base.latent_shapes = shapes  # the packed audio-video latent: audio carried at shift ratio
    kwargs = {"cross_attn": context, "device": context.device, "latent_shapes": shapes,
              "seed": case.get("seed", 0)}
    names = {"keyframes": "minimax_keyframes", "refs": "minimax_refs",
             "text_token_tags": "minimax_token_tags",
             "visual_cond_noise_aug": "minimax_visual_cond_noise_aug"}
    kwargs.update({names[k]: v for k, v in case.items() if k in names})
    if "masks" in case:
        kwargs["denoise_mask"] = comfy.utils.pack_latents(list(case["masks"]))[0]
    conds = base.extra_conds(**kwargs)
    out = {"context": conds["c_crossattn"].cond, "minimax_payload": conds["minimax_payload"].cond}
    for name in ("denoise_mask", "audio_denoise_mask"):
        if name in conds:
            out[name] = conds[name].cond
    return out


def twin_conds(twin, x, context, case: dict) -> dict:
    kwargs = {k: v for k, v in case.items() if k != "masks"}
    if "masks" in case:
        kwargs["denoise_masks"] = case["masks"]
    return make_conditioning(twin, context, x, audio_scale=twin.cfg.sigma_shift_video
                             / twin.cfg.sigma_shift_audio, **kwargs)


def run(model, x, t, conds, options=None):
    with torch.no_grad():
        return model(x, t, transformer_options={} if options is None else options, **conds)


def assert_equal(a, b):
    assert a[0].dtype == b[0].dtype and a[1].dtype == b[1].dtype
    assert torch.equal(a[0], b[0]), (a[0] - b[0]).abs().max()
    assert torch.equal(a[1], b[1]), (a[1] - b[1]).abs().max()


# ----------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adaln", ADALN)
def test_state_dicts_match(comfy, adaln, dtype):
    twin, base = pair(comfy, adaln, dtype)
    ours, theirs = twin.state_dict(), base.diffusion_model.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype
               for k in ours)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adaln", ADALN)
def test_t2va_with_the_refiner_in_the_forward(comfy, adaln, dtype):
    twin, base = pair(comfy, adaln, dtype)
    x, t, context = inputs(twin.cfg, DTYPES[dtype])
    assert_equal(run(base.diffusion_model, x, t, {"context": context}),
                 run(twin, x, t, {"context": context}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adaln", ADALN)
@pytest.mark.parametrize("case", ["t2va", "keyframes", "references", "noise_aug", "text_tags",
                                  "audio_mask"])
def test_sampler_conditioning_and_forward(comfy, adaln, dtype, case):
    """extra_conds (refiner once, payload, layout, audio carry 12/3, masks) then the forward."""
    if case == "audio_mask":
        comfy.release.skip_without("forward_masks", "denoise masks in the DiT forward (the "
                                   "sampler applies them outside the model)")
    twin, base = pair(comfy, adaln, dtype)
    x, t, context = inputs(twin.cfg, DTYPES[dtype])
    spec = {} if case == "t2va" else conditions(twin.cfg)[case]
    theirs, ours = upstream_conds(comfy, base, x, context, spec), twin_conds(twin, x, context,
                                                                              spec)
    assert torch.equal(theirs["context"], ours["context"])
    assert sorted(theirs) == sorted(ours)
    up_payload, twin_payload = theirs["minimax_payload"], ours["minimax_payload"]
    assert up_payload["audio_scale"] == twin_payload["audio_scale"] == 4.0
    assert up_payload["layout"].segments == twin_payload["layout"].segments
    assert torch.equal(up_payload["layout"].position_ids, twin_payload["layout"].position_ids)
    for name in ("denoise_mask", "audio_denoise_mask"):
        if name in theirs:
            assert torch.equal(theirs[name], ours[name])
    out_up = run(base.diffusion_model, x, t, theirs)
    out_twin = run(twin, x, t, ours)
    assert_equal(out_up, out_twin)
    if case != "t2va":  # the feature engaged: the output moved
        plain = run(twin, x, t, twin_conds(twin, x, context, {}))
        assert not torch.equal(out_twin[0], plain[0]) or not torch.equal(out_twin[1], plain[1])


def test_odd_latent_is_padded_like_comfyui(comfy):
    twin, base = pair(comfy, "pruned", "fp32")
    x, t, context = inputs(twin.cfg, torch.float32, latent_h=5, latent_w=3)
    assert_equal(run(base.diffusion_model, x, t, {"context": context}),
                 run(twin, x, t, {"context": context}))


def test_all_generate_video_mask_passes_through(comfy):
    twin, base = pair(comfy, "pruned", "bf16")
    x, t, context = inputs(twin.cfg, torch.bfloat16)
    conds = {"context": context, "denoise_mask": torch.ones(1, 1, 3, 4, 6)}
    assert_equal(run(base.diffusion_model, x, t, conds), run(twin, x, t, conds))


@pytest.mark.xfail(raises=AttributeError, strict=True,
                   reason="upstream @01a56b76 calls .to() on its float sigma_v when a video "
                          "denoise mask preserves any patch; compare here once upstream runs it")
def test_partial_video_mask(comfy):
    if not comfy.release.forward_masks:  # a skip inside a strict xfail reads as a skip
        pytest.skip("this ComfyUI's H3 has no denoise masks in the DiT forward")
    twin, base = pair(comfy, "pruned", "fp32")
    x, t, context = inputs(twin.cfg, torch.float32)
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, 0] = 0.0
    conds = {"context": context, "denoise_mask": mask}
    assert_equal(run(base.diffusion_model, x, t, conds), run(twin, x, t, conds))


def test_sigma_shifts_from_transformer_options_and_wrappers_see_the_same(comfy):
    """Shift overrides (MiniMaxH3SigmaShift) and DIFFUSION_MODEL wrappers, with the carry.

    (Only the ratio of the two shifts moves the audio sigma: 8 / 4, not 12 / 3.)
    """
    twin, base = pair(comfy, "pruned", "bf16")
    x, t, context = inputs(twin.cfg, torch.bfloat16)
    seen: dict = {"upstream": [], "twin": []}

    def options(side):
        def wrapper(executor, x, timestep, context, transformer_options, **kwargs):
            seen[side].append((x[1], sorted(kwargs)))
            return executor(x, timestep, context, transformer_options, **kwargs)
        return {"minimax_h3_sigma_shift_video": 8.0, "minimax_h3_sigma_shift_audio": 4.0,
                "wrappers": {"diffusion_model": {"probe": [wrapper]}}}

    conds = {"context": context, "minimax_payload": {"audio_scale": 4.0}}
    shifted = run(twin, x, t, conds, options("twin"))
    assert_equal(run(base.diffusion_model, x, t, conds, options("upstream")), shifted)
    (up_audio, up_keys), (our_audio, our_keys) = seen["upstream"][0], seen["twin"][0]
    assert torch.equal(up_audio, our_audio)
    masks = ("audio_denoise_mask", "denoise_mask")  # keywords only releases with them pass on
    assert up_keys == [k for k in our_keys if k not in masks or comfy.release.forward_masks]
    assert not torch.equal(shifted[1], run(twin, x, t, conds)[1])  # the shifts were used


# ----------------------------------------------------------------------------- hooks
def test_block_replace_patches_receive_the_same_args(comfy):
    twin, base = pair(comfy, "full", "bf16")
    x, t, context = inputs(twin.cfg, torch.bfloat16)
    spec = conditions(twin.cfg)["keyframes"]
    seen: dict = {"upstream": [], "twin": []}

    def recorder(side, model):
        def patch(args, extra):
            seen[side].append(args)
            calls = []

            def attention(h, **kwargs):  # a patch may hand the block its own attention
                calls.append(h.shape)
                return model.blocks[1].attn(h, **kwargs)

            if not comfy.release.patch_attention:  # 0.33.0: the block takes no attention
                return extra["original_block"](args)
            out = extra["original_block"]({**args, "attention": attention})
            assert len(calls) == 1
            return out
        return {"patches_replace": {"dit": {("double_block", 1): patch}}}

    out_up = run(base.diffusion_model, x, t, upstream_conds(comfy, base, x, context, spec),
                 recorder("upstream", base.diffusion_model))
    out_twin = run(twin, x, t, twin_conds(twin, x, context, spec), recorder("twin", twin))
    assert_equal(out_up, out_twin)
    (up,), (ours,) = seen["upstream"], seen["twin"]
    assert sorted(ours) == ["img", "layout", "mod_segments", "rope_freqs", "t_emb",
                            "transformer_options"]
    # the release's args are the twin's, less what it does not have yet
    assert sorted(up) == [k for k in sorted(ours) if k != "layout" or comfy.release.patch_layout]
    for name in ("img", "t_emb", "rope_freqs"):
        assert torch.equal(up[name], ours[name]), name
    assert up["mod_segments"] == ours["mod_segments"]
    if not comfy.release.patch_layout:
        return
    assert up["layout"].segments == ours["layout"].segments
    assert torch.equal(up["layout"].img_update, ours["layout"].img_update)
    assert torch.equal(up["layout"].audio_update, ours["layout"].audio_update)
    assert up["transformer_options"]["minimax_h3_layout"] is up["layout"]
    assert ours["transformer_options"]["minimax_h3_layout"] is ours["layout"]


def test_comfy_attention_config_loads_alike(comfy):
    comfy.release.skip_without("comfy_attention", "per-module ComfyAttention (comfy_attention."
                               "config state-dict entries)")
    cfg = TwinConfig.tiny()
    twin = make_twin(cfg, seed=1)
    base = pair(comfy, "pruned", "fp32")[1]
    reference = comfy.h3.MiniMaxH3Model(**cfg.upstream_kwargs(), dtype=torch.float32,
                                        device="cpu", operations=comfy.ops.disable_weight_init)
    state = twin.state_dict()
    state["blocks.2.attn.comfy_attention.config"] = attention_config_tensor("comfy_kitchen_int8")
    twin.load_state_dict(dict(state))
    reference.load_state_dict(dict(state))
    ours, theirs = twin.blocks[2].attn.comfy_attention, reference.blocks[2].attn.comfy_attention
    assert ours.config == theirs.config == {"attention": "comfy_kitchen_int8"}
    assert (ours.function is None) == (theirs.function is None)
    assert list(twin.state_dict()) == list(reference.state_dict())
    assert base is not reference


def test_twin_on_comfy_operations_is_the_same_twin(comfy):
    cfg = TwinConfig.tiny()
    plain = make_twin(cfg, dtype=torch.bfloat16, seed=4)
    on_ops = make_twin(cfg, dtype=torch.bfloat16, seed=4,
                       operations=comfy.ops.disable_weight_init)
    assert type(on_ops.blocks[0].attn.qkv_proj).__module__ == "comfy.ops"
    x, t, context = inputs(cfg, torch.bfloat16)
    assert_equal(run(plain, x, t, {"context": context}), run(on_ops, x, t, {"context": context}))


def _on(device, case: dict) -> dict:
    """The case's tensors on `device` (keyframe / reference latents and masks)."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(move(v) for v in value)
        return value
    return move(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["t2va", "keyframes", "references", "audio_mask"])
def test_gpu_bf16_forward_is_bit_identical(comfy, case):
    """On a GPU, bf16, 128-wide heads: upstream and twin run the same CUDA kernels in order."""
    if case == "audio_mask":
        comfy.release.skip_without("forward_masks", "denoise masks in the DiT forward (the "
                                   "audio mask conditions it through the sampler only)")
    twin, base = pair(comfy, "gpu", "bf16", "cuda")
    shape = {"latent_t": 3, "audio_t": 5}
    x, t, context = inputs(twin.cfg, torch.bfloat16, latent_h=4, latent_w=6, device="cuda",
                           shape=shape)
    spec = {} if case == "t2va" else _on("cuda", conditions(twin.cfg)[case])
    theirs = upstream_conds(comfy, base, x, context, spec)
    ours = twin_conds(twin, x, context, spec)
    assert_equal(run(base.diffusion_model, x, t, theirs), run(twin, x, t, ours))
