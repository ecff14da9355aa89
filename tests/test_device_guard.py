"""The device guard: the DiT, the text encoder and the VAEs run with their own GPU current.

`device_guard.device_context` is the seam: the tests replace it with a recorder, so the CPU
shows which device each guarded call made current (and that unguarded calls made none).
The `comfyui` tests run the real MiniMaxH3 through the real ModelPatcher and sampler path; the
`multi_gpu` test runs the unpatched real model on cuda:1 while cuda:0 is current.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from twin import TwinPatcher

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking
from h3_multigpu.comfy_seam.names import DIFFUSION_MODEL, GUARD_KEY, OUTER_SAMPLE
from h3_multigpu.guard import device as device_guard
from h3_multigpu.guard.device import (
    DeviceGuardedMethod,
    guard_diffusion_model,
    guard_text_encoder,
    guard_vae,
    has_device_guard,
)
from h3_multigpu.nodes import comfy_placement, features
from h3_multigpu.nodes.features import apply_from_strings

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


class Recorder:
    """Replaces `device_context`: remembers each device made current and the one current now."""

    def __init__(self):
        self.entered: list[torch.device] = []
        self.stack: list[torch.device] = []

    @property
    def current(self) -> torch.device | None:
        return self.stack[-1] if self.stack else None

    @contextlib.contextmanager
    def __call__(self, device):
        device = torch.device(device)
        self.entered.append(device)
        self.stack.append(device)
        try:
            yield
        finally:
            self.stack.pop()


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(device_guard, "device_context", rec)
    return rec


class _Executor:
    """What ComfyUI's WrapperExecutor hands a wrapper: callable, with `class_obj`."""

    def __init__(self, class_obj, recorder: Recorder):
        self.class_obj = class_obj
        self.recorder = recorder
        self.seen: list[torch.device | None] = []

    def __call__(self, *args, **kwargs):
        self.seen.append(self.recorder.current)
        return "result"


class _Guider:
    def __init__(self, load_device):
        self.model_patcher = type("P", (), {"load_device": load_device})()


# ---------------------------------------------------------------------- the wrappers
def test_outer_sample_makes_the_patchers_load_device_current(recorder):
    executor = _Executor(_Guider(GPU1), recorder)
    assert device_guard.outer_sample_guard(executor, "noise", sigmas=None) == "result"
    assert executor.seen == [GPU1] and recorder.entered == [GPU1]


def test_diffusion_model_guard_follows_the_forward_input(recorder):
    executor = _Executor(object(), recorder)
    video = torch.empty(0, device="meta")  # H3 passes [video, audio]
    device_guard.diffusion_model_guard(executor, [video, video], torch.ones(1), None, {})
    assert executor.seen == [torch.device("meta")]
    device_guard.diffusion_model_guard(executor, "no tensor")  # nothing to follow: no context
    assert executor.seen[-1] is None and len(recorder.entered) == 1


def test_guard_is_installed_once_and_encloses_other_wrappers():
    patcher = TwinPatcher(torch.nn.Linear(2, 2))
    patcher.add_wrapper_with_key(DIFFUSION_MODEL, "other.pack", lambda ex, *a, **k: ex(*a, **k))
    assert not has_device_guard(patcher)
    guard_diffusion_model(patcher)
    guard_diffusion_model(patcher)  # a second feature installing it again changes nothing
    wrappers = patcher.model_options["transformer_options"]["wrappers"]
    assert list(wrappers[DIFFUSION_MODEL]) == [GUARD_KEY, "other.pack"]  # outermost
    assert wrappers[DIFFUSION_MODEL][GUARD_KEY] == [device_guard.diffusion_model_guard]
    assert wrappers[OUTER_SAMPLE][GUARD_KEY] == [device_guard.outer_sample_guard]
    assert has_device_guard(patcher) and has_device_guard(patcher.clone())


def test_every_feature_apply_installs_the_guard(tiny_twin, monkeypatch):
    base = TwinPatcher(tiny_twin)
    # a feature installs no guard of its own (features do not call each other): the nodes'
    # glue, which composes them, guards whatever a feature's apply returns
    assert not has_device_guard(apply_activation_chunking(base, ChunkingConfig(ffn_chunk=8)))
    chunked = apply_from_strings(base, "chunking", ffn_chunk="8")
    assert has_device_guard(chunked) and not has_device_guard(base)
    load = features._load

    def unguarded_apply(module, *names):
        if names[0].startswith("apply_"):
            return (lambda model, config: model.clone(),)
        return load(module, *names)

    monkeypatch.setattr(features, "_load", unguarded_apply)
    for feature, options in (("dual_sage", dict(helpers="cpu", split="auto")),
                             ("prefetch", dict(resident_blocks="1")), ("sequence", {})):
        try:
            glued = apply_from_strings(base, feature, **options)
        except features.FeatureUnavailable:
            continue
        assert has_device_guard(glued) and not has_device_guard(base), feature


# ---------------------------------------------------------------------- text encoder / VAE
class _Coder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((1,), 2.0))

    def encode(self, x):
        return x * self.scale

    def decode(self, z, **kwargs):
        return z / self.scale

    def encode_token_weights(self, tokens):
        return torch.tensor([float(len(tokens))]), None


class _ObjectPatcher:
    """The ModelPatcher surface the guard uses: get_model_object / add_object_patch, and the
    model_options the seam records its installs in."""

    def __init__(self, model, load_device):
        self.model, self.load_device = model, load_device
        self.object_patches: dict = {}
        self.model_options: dict = {}

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        return getattr(self.model, name)

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def loaded(self):  # what ModelPatcher.patch_model does with object patches while loading
        for name, obj in self.object_patches.items():
            setattr(self.model, name, obj)
        return self.model


class _Holder:  # a CLIP or VAE: something with a `.patcher`
    def __init__(self, patcher):
        self.patcher = patcher


def test_vae_and_text_encoder_run_with_their_device_current(recorder):
    vae = _Holder(_ObjectPatcher(_Coder(), GPU0))
    assert guard_vae(vae) == 2
    coder = vae.patcher.loaded()
    assert torch.equal(coder.decode(coder.encode(torch.ones(3))), torch.ones(3))
    assert recorder.entered == [GPU0, GPU0]
    # placed again on another GPU: re-targeted, not nested
    assert guard_vae(vae, GPU1) == 2
    patched = vae.patcher.object_patches["decode"]
    assert isinstance(patched, DeviceGuardedMethod) and patched.device == GPU1
    assert not isinstance(patched.original, DeviceGuardedMethod)
    clip = _Holder(_ObjectPatcher(_Coder(), GPU0))
    assert guard_text_encoder(clip) == 1
    assert clip.patcher.loaded().encode_token_weights([1, 2])[0].item() == 2.0
    assert recorder.entered[-1] == GPU0


def test_a_method_patched_by_another_pack_stays_in_the_chain(recorder):
    vae = _Holder(_ObjectPatcher(_Coder(), GPU1))
    calls = []
    original = vae.patcher.model.decode

    def other(z, **kwargs):
        calls.append(recorder.current)
        return original(z, **kwargs)

    vae.patcher.add_object_patch("decode", other)
    guard_vae(vae)
    vae.patcher.loaded().decode(torch.ones(2))
    assert calls == [GPU1]  # the other patch ran, inside the guard


@pytest.mark.skipif(importlib.util.find_spec("comfy") is not None,
                    reason="checks the fallback taken when ComfyUI is absent")
def test_placement_guards_what_it_places(tiny_twin):
    model = TwinPatcher(tiny_twin)
    placed, _ = comfy_placement.place_model(model, 1)
    assert has_device_guard(placed) and not has_device_guard(model)
    coder_patcher = _ObjectPatcher(_Coder(), torch.device("cpu"))
    coder_patcher.clone = lambda: _cloned(coder_patcher)
    vae = _Holder(coder_patcher)
    vae.first_stage_model, vae.device = coder_patcher.model, torch.device("cpu")
    placed_vae, _ = comfy_placement.place_vae(vae, 0)
    assert set(placed_vae.patcher.object_patches) == {"encode", "decode"}
    assert placed_vae.patcher.object_patches["decode"].device == GPU0
    assert vae.patcher.object_patches == {}  # the loader's VAE is untouched


def _cloned(patcher: _ObjectPatcher) -> _ObjectPatcher:
    clone = _ObjectPatcher(patcher.model, patcher.load_device)
    clone.object_patches = dict(patcher.object_patches)
    clone.clone = lambda: _cloned(clone)
    return clone


# ---------------------------------------------------------------------- the real ComfyUI
@pytest.mark.comfyui
@pytest.mark.parametrize("feature", ["placement", "chunking"])
def test_real_sampler_runs_the_dit_and_refiner_with_the_load_device_current(recorder, feature):
    """Every attention call of the sampling run (the token refiner in extra_conds and each DiT
    block) happens with the DiT's device current, through the real sampler path."""
    from comfyui_h3 import (
        TinyH3Config,
        import_comfyui_or_skip,
        make_inputs,
        make_tiny_h3,
        run_like_sampler,
        unload_all,
    )

    comfy = import_comfyui_or_skip()
    unload_all()
    config = TinyH3Config()
    patcher = make_tiny_h3(config, seed=0)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    h3 = comfy.ldm.minimax.model
    original = h3.optimized_attention
    seen: list = []

    def probe(*args, **kwargs):
        seen.append(recorder.current)
        return original(*args, **kwargs)

    probe.container_function = getattr(original, "container_function", None)
    h3.optimized_attention = probe
    try:
        reference = run_like_sampler(patcher, inputs)
        assert seen == [None] * (config.refiner_blocks + config.blocks)  # ComfyUI: no guard
        seen.clear()
        if feature == "placement":
            guarded = guard_diffusion_model(patcher.clone())
        else:
            # the nodes' path: the feature, then the guard the glue composes around it
            guarded = apply_from_strings(patcher, "chunking", ffn_chunk="7")
        out = run_like_sampler(guarded, inputs)
    finally:
        h3.optimized_attention = original
        unload_all()
    load = torch.device(patcher.load_device)
    assert seen == [load] * (config.refiner_blocks + config.blocks)
    assert recorder.entered == [load, load]  # the sampling run, and its one DiT forward
    if feature == "placement":  # the guard changes no number (chunking's own tests check it)
        assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))


@pytest.mark.comfyui
def test_real_model_patcher_applies_the_vae_and_text_encoder_guards(recorder):
    """Object patches reach the method through ComfyUI's own load (patch_model) and leave with
    its unload (unpatch_model)."""
    from comfyui_h3 import import_comfyui_or_skip, unload_all

    comfy = import_comfyui_or_skip()
    unload_all()
    coder = _Coder()
    patcher = comfy.model_patcher.ModelPatcher(coder, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    holder = _Holder(patcher)
    assert guard_vae(holder) == 2 and guard_text_encoder(holder) == 1
    comfy.model_management.load_models_gpu([patcher])
    try:
        coder.decode(coder.encode(torch.ones(2)))
        coder.encode_token_weights([0])
    finally:
        unload_all()
    assert recorder.entered == [torch.device("cpu")] * 3
    assert not isinstance(coder.decode, DeviceGuardedMethod)  # ComfyUI restored it on unload


@pytest.mark.comfyui
@pytest.mark.multi_gpu
def test_unpatched_real_model_on_cuda1_runs_through_placement_while_cuda0_is_current():
    """The unpatched real model (bf16) on cuda:1 with cuda:0 current: through our placement it
    runs (comfy-kitchen's DLPack export needs its device current) and equals ComfyUI's own
    result computed with cuda:1 current; with a bypass LoRA too (its adapters move to the
    current device when injected)."""
    from comfyui_h3 import (
        TinyH3Config,
        import_comfyui_or_skip,
        make_inputs,
        make_lora_state_dict,
        make_tiny_h3,
        run_like_sampler,
        unload_all,
        with_bypass_lora,
    )

    import_comfyui_or_skip()
    config = TinyH3Config(dtype=torch.bfloat16)
    patcher = make_tiny_h3(config, seed=0, load_device=GPU1)
    inputs = make_inputs(config, keyframe=True, audio_mask=True)
    bypass = with_bypass_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    torch.cuda.set_device(0)
    for model in (patcher, bypass):
        unload_all()
        with torch.cuda.device(1):
            reference = run_like_sampler(model, inputs)
        unload_all()
        placed, note = comfy_placement.place_model(model, 1)
        assert "gpu:1" in note and has_device_guard(placed)
        out = run_like_sampler(placed, inputs)
        assert torch.cuda.current_device() == 0  # restored after the run
        assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
        unload_all()
