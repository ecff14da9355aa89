"""Run the real ComfyUI MiniMax H3 model in-process: a tiny real model, the real ModelPatcher,
the real sampler path, weight-patch LoRA cycles and attention call counters.

    comfy = import_comfyui_or_skip()              # pytest.skip with the reason when unusable
    patcher = make_tiny_h3(TinyH3Config(adaln="curve"), seed=0)
    inputs = make_inputs(TinyH3Config(), keyframe=True, audio_mask=True)
    base = run_like_sampler(patcher, inputs)      # (video, audio) after one real sampler step
    lora = with_lora(patcher, make_lora_state_dict(patcher, rank=4, seed=3))
    on = run_like_sampler(lora, inputs)           # ComfyUI patches the weights while loading
    off = run_like_sampler(patcher, inputs)       # ComfyUI unpatches them: equal to `base`
    with AttentionCounter() as calls:
        run_like_sampler(patcher, inputs)
    assert calls.default == calls.entered == 4    # 2 refiner blocks (extra_conds) + 2 DiT blocks

ComfyUI is found through $COMFYUI_PATH and imported into this process. Its `comfy.cli_args`
only parses sys.argv when `comfy.options.args_parsing` is on, so importing it here reads the
defaults; on a machine without CUDA the harness sets `--cpu` before `comfy.model_management`
is imported (that import raises RuntimeError on a GPU-less machine otherwise).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from h3_checkpoints import DiTShape, write_dit

_IMPORT_ERROR: str | None = None
_COMFY: ModuleType | None = None


class ComfyUIUnavailable(RuntimeError):
    """ComfyUI (with the MiniMax H3 model) cannot be imported here; the message says why."""


def import_comfyui(path: str | os.PathLike | None = None) -> ModuleType:
    """Import ComfyUI from `path` (default $COMFYUI_PATH) and return its `comfy` package.

    Raises ComfyUIUnavailable with the reason when the path is unset, the import fails for any
    reason (missing requirements, no GPU driver, ...) or the tree has no H3 model.
    """
    global _COMFY, _IMPORT_ERROR
    if _COMFY is not None:
        return _COMFY
    if _IMPORT_ERROR is not None:
        raise ComfyUIUnavailable(_IMPORT_ERROR)
    root = os.fspath(path) if path is not None else os.environ.get("COMFYUI_PATH")
    try:
        if not root:
            raise ComfyUIUnavailable("set COMFYUI_PATH to a ComfyUI checkout")
        if not os.path.isfile(os.path.join(root, "comfy", "model_patcher.py")):
            raise ComfyUIUnavailable(f"COMFYUI_PATH={root} holds no comfy/model_patcher.py")
        if root not in sys.path:
            sys.path.insert(0, root)
        import comfy.cli_args
        import comfy.options  # noqa: F401  (args_parsing stays off: sys.argv is not parsed)

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        for name in ("comfy.model_management", "comfy.model_patcher", "comfy.model_base",
                     "comfy.samplers", "comfy.sample", "comfy.sd", "comfy.lora",
                     "comfy.nested_tensor", "comfy.supported_models",
                     "comfy.ldm.modules.attention"):
            importlib.import_module(name)
        try:
            importlib.import_module("comfy.ldm.minimax.model")
        except ImportError as exc:
            raise ComfyUIUnavailable(f"this ComfyUI has no MiniMax H3 model "
                                     f"(comfy.ldm.minimax): {exc}") from exc
        import comfy
        if not hasattr(comfy.model_base, "MiniMaxH3"):
            raise ComfyUIUnavailable("this ComfyUI has no comfy.model_base.MiniMaxH3")
    except ComfyUIUnavailable as exc:
        _IMPORT_ERROR = str(exc)
        raise
    except BaseException as exc:  # ImportError, RuntimeError (no GPU driver), SystemExit, ...
        if isinstance(exc, KeyboardInterrupt):
            raise
        _IMPORT_ERROR = f"importing ComfyUI from {root} failed: {type(exc).__name__}: {exc}"
        raise ComfyUIUnavailable(_IMPORT_ERROR) from exc
    _COMFY = comfy
    return comfy


def import_comfyui_or_skip(path: str | os.PathLike | None = None) -> ModuleType:
    """`import_comfyui`, turning ComfyUIUnavailable into pytest.skip with the reason."""
    import pytest

    try:
        return import_comfyui(path)
    except ComfyUIUnavailable as exc:
        pytest.skip(str(exc))


def enable_dynamic_vram(vram_headroom_bytes: int = 0) -> ModuleType:
    """Run this process's ComfyUI with DynamicVRAM (comfy-aimdo), as its main.py switches it on
    (0.33.0 and the newest files), and return the `comfy` package:
    `comfy_aimdo.control.init()` before ComfyUI's modules import comfy-aimdo's (each reads the
    library when imported), `init_devices` for every GPU (with `vram_headroom_bytes`, main.py's
    --vram-headroom), `CoreModelPatcher = ModelPatcherDynamic`, `aimdo_enabled = True`.

    Call it before anything imports ComfyUI in this process (`tests/dynamic_vram_cases.py` runs
    in a process of its own). Raises ComfyUIUnavailable with the reason when DynamicVRAM cannot
    run here: no CUDA/ROCm GPU, comfy-aimdo missing or refusing, ComfyUI imported without it.
    """
    memory = sys.modules.get("comfy.memory_management")
    if memory is not None and getattr(memory, "aimdo_enabled", False):
        return import_comfyui()  # already on in this process
    if not torch.cuda.is_available():
        raise ComfyUIUnavailable("DynamicVRAM needs a CUDA/ROCm GPU (comfy-aimdo)")
    try:
        import comfy_aimdo.control as control
    except ImportError as exc:
        raise ComfyUIUnavailable(f"comfy-aimdo is not installed ({exc}): pip install "
                                 "comfy-aimdo (a ComfyUI requirement)") from exc
    if control.lib is None and "comfy.model_management" in sys.modules:
        raise ComfyUIUnavailable("ComfyUI was imported in this process before DynamicVRAM was "
                                 "switched on: run the DynamicVRAM tests in a process of their "
                                 "own (tests/test_dynamic_vram_gpu.py starts one)")
    ready = False
    for kwargs in ({"nvml_pressure": True}, {}):  # comfy-aimdo 0.4.10+, then 0.4.9's protocol
        try:
            ready = control.init(**kwargs)
            break
        except TypeError:
            continue
    if not ready:
        raise ComfyUIUnavailable("comfy-aimdo did not load its library (see the log)")
    comfy = import_comfyui()
    devices = comfy.model_management.get_all_torch_devices()
    try:
        ready = control.init_devices((d.index, int(vram_headroom_bytes)) for d in devices)
    except TypeError:  # comfy-aimdo 0.4.9
        ready = control.init_devices(d.index for d in devices)
    if not ready:
        raise ComfyUIUnavailable("comfy-aimdo refused the GPUs (init_devices returned False)")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return comfy


# ---------------------------------------------------------------------------------------------
# The tiny real model
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyH3Config:
    """A tiny MiniMaxH3Model that keeps H3's 128-dim heads and its rope split (3 x 16 freqs).

    adaln="curve" is the pruned checkpoint form (`adaln_t_table`, no time embedder, fp32
    AdaLN projections without SiLU); adaln="full" has the time embedder and model-dtype AdaLN.
    """

    hidden: int = 256
    heads: int = 2
    head_dim: int = 128
    ffn: int = 512
    blocks: int = 2
    refiner_blocks: int = 2
    text_dim: int = 64
    time_embed_dim: int = 128
    adaln: str = "curve"
    curve_grid: int = 33
    dtype: torch.dtype = torch.float32
    weights: str = "float"   # "float": stored in `dtype`; "int8_convrot": the official DiT format

    def __post_init__(self):
        if self.adaln not in ("curve", "full"):
            raise ValueError(f"adaln={self.adaln!r}: use 'curve' (pruned) or 'full'")
        if self.weights not in ("float", "int8_convrot"):
            raise ValueError(f"weights={self.weights!r}: use 'float' or 'int8_convrot'")

    def file_format(self) -> str:
        """The checkpoint format (tests/h3_checkpoints.py) these weights are stored in."""
        if self.weights == "int8_convrot":
            return "int8_convrot"
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def unet_config(self) -> dict[str, Any]:
        return {
            "image_model": "minimax_h3",
            "hidden_size": self.hidden,
            "num_layers": self.blocks,
            "token_refiner_num_layers": self.refiner_blocks,
            "num_attention_heads": self.heads,
            "attention_head_dim": self.head_dim,
            "ffn_hidden_size": self.ffn,
            "text_dim": self.text_dim,
            "time_embed_hidden_size": self.hidden,
            "time_embed_dim": self.time_embed_dim,
            "adaln_curve_grid": self.curve_grid if self.adaln == "curve" else None,
        }


def checkpoint_shape(config: TinyH3Config) -> DiTShape:
    """The checkpoint dimensions of a tiny config (what ComfyUI's detection reads back)."""
    return DiTShape(hidden=config.hidden, heads=config.heads, head_dim=config.head_dim,
                    ffn=config.ffn, blocks=config.blocks, refiner_blocks=config.refiner_blocks,
                    text_dim=config.text_dim, time_embed_dim=config.time_embed_dim,
                    curve_grid=config.curve_grid if config.adaln == "curve" else None,
                    time_embed_hidden=config.hidden)


_CHECKPOINT_DIR: str | None = None


def tiny_checkpoint(config: TinyH3Config = TinyH3Config(), *, seed: int = 0) -> str:
    """The path of a seeded tiny DiT file in the config's weight format (written once per
    process, into a temporary folder removed at exit)."""
    global _CHECKPOINT_DIR
    if _CHECKPOINT_DIR is None:
        _CHECKPOINT_DIR = tempfile.mkdtemp(prefix="h3_checkpoints_")
        atexit.register(shutil.rmtree, _CHECKPOINT_DIR, True)
    fmt = config.file_format()
    shape = checkpoint_shape(config)
    name = f"dit_{fmt}_{seed}_{abs(hash(shape)):x}.safetensors"
    path = os.path.join(_CHECKPOINT_DIR, name)
    if not os.path.exists(path):
        import_comfyui()
        write_dit(path, shape, fmt, seed=seed)
    return path


def load_dit(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
             load_device: torch.device | str | None = None,
             offload_device: torch.device | str | None = None):
    """A DiT file loaded the way UNETLoader loads it (`comfy.sd.load_diffusion_model`), with
    the compute dtype and devices as model_options. Whatever patcher class ComfyUI's loader
    picks (ModelPatcherDynamic under DynamicVRAM) is what comes back."""
    comfy = import_comfyui()
    options: dict[str, Any] = {}
    if dtype is not None:
        options["dtype"] = dtype
    if load_device is not None:
        options["load_device"] = torch.device(load_device)
    if offload_device is not None:
        options["offload_device"] = torch.device(offload_device)
    with torch.inference_mode():  # ComfyUI's executor runs every node (UNETLoader too) in it
        patcher = comfy.sd.load_diffusion_model(os.fspath(path), model_options=options)
    if patcher is None:
        raise RuntimeError(f"ComfyUI did not recognise {path} as a diffusion model")
    if load_device is not None and str(patcher.load_device) != str(torch.device(load_device)):
        # releases whose loader ignores the load_device option
        patcher.load_device = torch.device(load_device)
    return patcher


def make_tiny_h3(config: TinyH3Config = TinyH3Config(), *, seed: int = 0,
                 load_device: torch.device | str | None = None,
                 offload_device: torch.device | str = "cpu"):
    """The real `comfy.model_base.MiniMaxH3`, loaded by ComfyUI's own loader from a seeded
    tiny checkpoint in the config's weight format (`tiny_checkpoint`), in a real ModelPatcher.

    load_device defaults to ComfyUI's torch device (CPU here); the weights stay on the offload
    device until ComfyUI loads the model, as with UNETLoader.
    """
    return load_dit(tiny_checkpoint(config, seed=seed), dtype=config.dtype,
                    load_device=load_device, offload_device=offload_device)


# ---------------------------------------------------------------------------------------------
# Inputs the way ComfyUI's H3 nodes hand them to the sampler
# ---------------------------------------------------------------------------------------------

@dataclass
class H3Inputs:
    latent: Any                       # comfy.nested_tensor.NestedTensor (video, audio)
    noise: Any                        # same structure
    positive: list                    # ComfyUI CONDITIONING: [[cross_attn, {extra}]]
    denoise_mask: Any | None = None   # NestedTensor (video mask, audio mask) or None
    extra: dict = field(default_factory=dict)


def make_inputs(config: TinyH3Config = TinyH3Config(), *,
                latent_thw: tuple[int, int, int] = (3, 4, 6), audio_t: int = 5,
                text_len: int = 16, keyframe: bool = False,
                audio_mask: bool = False, seed: int = 1) -> H3Inputs:
    """Seeded latent (video [1,24,T,H,W] + audio [1,32,2,Ta]), noise and conditioning.

    keyframe=True adds one first-frame keyframe condition (a clean [1,24,1,H,W] latent at
    frame 0, `minimax_keyframes`, as MiniMaxH3ImageToVideo sets it). audio_mask=True keeps the
    first two audio latent frames (denoise mask 0 there, 1 elsewhere).
    """
    comfy = import_comfyui()
    gen = torch.Generator().manual_seed(seed)
    t, h, w = latent_thw
    video = torch.randn((1, 24, t, h, w), generator=gen)
    audio = torch.randn((1, 32, 2, audio_t), generator=gen)
    noise_v = torch.randn((1, 24, t, h, w), generator=gen)
    noise_a = torch.randn((1, 32, 2, audio_t), generator=gen)
    context = torch.randn((1, text_len, config.text_dim), generator=gen)
    extra: dict[str, Any] = {}
    if keyframe:
        extra["minimax_keyframes"] = [{
            "latent": torch.randn((1, 24, 1, h, w), generator=gen),
            "resolved_frame_index": 0,
        }]
    nested = comfy.nested_tensor.NestedTensor
    mask = None
    if audio_mask:
        audio_keep = torch.ones((1, 1, 2, audio_t))
        audio_keep[..., :2] = 0.0
        mask = nested((torch.ones((1, 1, t, h, w)), audio_keep))
    return H3Inputs(latent=nested((video, audio)), noise=nested((noise_v, noise_a)),
                    positive=[[context, extra]], denoise_mask=mask, extra=extra)


# ---------------------------------------------------------------------------------------------
# One sampler run, LoRA, loading
# ---------------------------------------------------------------------------------------------

def _guider_class():
    comfy = import_comfyui()

    class PositiveOnlyGuider(comfy.samplers.CFGGuider):
        """cfg 1 with the positive conds only, as BasicGuider (the H3 template's guider)."""

        def set_conds(self, positive):
            self.inner_set_conds({"positive": positive})

    return PositiveOnlyGuider


@contextlib.contextmanager
def _lowvram_budget(patcher, budget_bytes: int):
    """Make ComfyUI's loader give `patcher` a lowvram budget of `budget_bytes`.

    A CPU load device is always loaded fully by `load_models_gpu`; this replaces, for this one
    patcher, the budget it passes to `LoadedModel.model_load` with the given one, so ComfyUI's
    own partial-load code (LowVramPatch weight functions, comfy_cast_weights) runs as it does
    on a GPU short of memory. Models are unloaded on entry, on every device, so the budget is
    not cumulative: ComfyUI's `unload_all_models` frees only its current device, and a model it
    leaves loaded elsewhere (a DiT on cuda:1 while cuda:0 is current) would be partially loaded
    again with this budget plus what it already held (more modules patched at load in fp32,
    fewer LowVramPatch ones, which compute the LoRA in the weight's dtype).
    """
    comfy = import_comfyui()
    loaded_model_cls = comfy.model_management.LoadedModel
    original = loaded_model_cls.model_load
    unload_all()

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        # clones of the model, and ComfyUI's per-GPU deepclones of it (the sequence mode's
        # helpers keep its clone_base_uuid): every device loads the same modules partially
        if self.model is patcher or self.model.is_clone(patcher) or \
                getattr(self.model, "clone_base_uuid", None) == patcher.clone_base_uuid:
            lowvram_model_memory = max(1, int(budget_bytes))
        return original(self, lowvram_model_memory, force_patch_weights=force_patch_weights)

    loaded_model_cls.model_load = model_load
    try:
        yield
    finally:
        loaded_model_cls.model_load = original


def run_like_sampler(patcher, inputs: H3Inputs, *, sigmas=(0.9, 0.0), seed: int = 0,
                     sampler_name: str = "euler", lowvram_bytes: int | None = None,
                     callback=None, negative: list | None = None, cfg: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `inputs` with ComfyUI's own sampler path and return (video, audio) on the CPU.

    This is SamplerCustomAdvanced with BasicGuider: `CFGGuider.sample` packs the nested latent,
    `prepare_sampling` loads the patcher through `load_models_gpu` (weight patches such as LoRA
    are applied there, and removed when another clone of the same model is loaded),
    `process_conds` runs `MiniMaxH3.extra_conds` once (token refiner, PackedLayout, payload),
    and each step calls `apply_model` with the patcher's model_options (transformer_options,
    wrappers, patches_replace). The default sigmas (0.9, 0) make one model call, and the
    result is that call's x0 prediction. lowvram_bytes gives the model a partial-load budget
    (see `_lowvram_budget`). With `negative` it is CFGGuider at `cfg` (KSampler's guider: cond
    and uncond each step, which ComfyUI's MultiGPU CFG Split shares among its clones).
    """
    comfy = import_comfyui()
    if negative is None:
        guider = _guider_class()(patcher)
        guider.set_conds(inputs.positive)
    else:
        guider = comfy.samplers.CFGGuider(patcher)
        guider.set_conds(inputs.positive, negative)
    guider.set_cfg(cfg)
    sampler = comfy.samplers.sampler_object(sampler_name)
    sigmas = torch.tensor(sigmas, dtype=torch.float32)
    latent = comfy.sample.fix_empty_latent_channels(patcher, inputs.latent)
    ctx = _lowvram_budget(patcher, lowvram_bytes) if lowvram_bytes is not None \
        else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        out = guider.sample(inputs.noise, latent, sampler, sigmas, denoise_mask=inputs.denoise_mask,
                            callback=callback, disable_pbar=True, seed=seed)
    video, audio = out.unbind()[:2]
    return video.detach().cpu().clone(), audio.detach().cpu().clone()


def unload_all() -> None:
    """ComfyUI's own 'unload everything' (what its /free endpoint does), weights unpatched, on
    every device a model is loaded on (`unload_all_models` frees only ComfyUI's default one;
    a DiT on cuda:1 would stay loaded)."""
    comfy = import_comfyui()
    mm = comfy.model_management
    mm.unload_all_models()
    for device in {loaded.device for loaded in mm.current_loaded_models}:
        mm.free_memory(1e30, device)
    mm.soft_empty_cache()


DEFAULT_LORA_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def make_lora_state_dict(patcher, *, rank: int = 4, seed: int = 3, scale: float = 0.5,
                         targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
                         include_refiner: bool = True) -> dict[str, torch.Tensor]:
    """A seeded LoRA file's state dict (`diffusion_model.<module>.lora_up/lora_down.weight`,
    `.alpha`) for the DiT blocks' (and refiner blocks') linears named in `targets`."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    model = patcher.model.diffusion_model
    for name, module in sorted(model.named_modules()):
        if not any(name.endswith(t) for t in targets):
            continue
        in_refiner = include_refiner and name.startswith("token_refiner.")
        if not (name.startswith("blocks.") or in_refiner):
            continue
        out_f, in_f = module.weight.shape
        key = f"diffusion_model.{name}"
        sd[f"{key}.lora_down.weight"] = torch.randn((rank, in_f), generator=gen) / in_f ** 0.5
        up = torch.randn((out_f, rank), generator=gen)
        sd[f"{key}.lora_up.weight"] = scale * up / rank ** 0.5
        sd[f"{key}.alpha"] = torch.tensor(float(rank))
    return sd


def with_lora(patcher, lora_state_dict: dict[str, torch.Tensor], strength: float = 1.0):
    """What LoraLoaderModelOnly does: a clone of `patcher` with the LoRA as weight patches."""
    comfy = import_comfyui()
    lora_patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora_state_dict, strength, 0.0)
    if not lora_patcher.patches:
        raise RuntimeError("the LoRA matched no weight of the model")
    return lora_patcher


def with_bypass_lora(patcher, lora_state_dict: dict[str, torch.Tensor], strength: float = 1.0):
    """What ComfyUI's on-activation ("bypass") LoRA loader does: a clone of `patcher` whose
    adapted linears run `g(f(x) + h(x))` through comfy.weight_adapter's BypassForwardHook,
    injected by the patcher while it loads (weights untouched).

    Uses comfy.sd.load_bypass_lora_for_models where this ComfyUI has it; otherwise the same
    steps through the public pieces (load_lora, BypassInjectionManager, set_injections).
    """
    comfy = import_comfyui()
    try:
        from comfy.weight_adapter import BypassInjectionManager, WeightAdapterBase
    except ImportError as exc:
        raise ComfyUIUnavailable(f"this ComfyUI has no bypass LoRA (comfy.weight_adapter): "
                                 f"{exc}") from exc
    loader = getattr(comfy.sd, "load_bypass_lora_for_models", None)
    if loader is not None:
        lora_patcher, _ = loader(patcher, None, lora_state_dict, strength, 0.0)
    else:
        key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
        loaded = comfy.lora.load_lora(lora_state_dict, key_map)
        lora_patcher = patcher.clone()
        manager = BypassInjectionManager()
        model_keys = set(lora_patcher.model.state_dict().keys())
        for key, adapter in loaded.items():
            if isinstance(adapter, WeightAdapterBase) and key in model_keys:
                manager.add_adapter(key, adapter, strength=strength)
        injections = manager.create_injections(lora_patcher.model)
        if manager.get_hook_count() > 0:
            lora_patcher.set_injections("bypass_lora", injections)
    if not lora_patcher.injections.get("bypass_lora"):
        raise RuntimeError("the bypass LoRA matched no linear of the model")
    return lora_patcher


def bypass_adapted_modules(patcher) -> int:
    """How many modules of the model currently run a bypass adapter (injected forward)."""
    count = 0
    for module in patcher.model.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and hasattr(getattr(forward, "__self__", None), "adapter"):
            count += 1
    return count


def lowvram_patched_modules(patcher) -> int:
    """How many modules currently carry ComfyUI's LowVramPatch weight function (lowvram LoRA)."""
    comfy = import_comfyui()
    count = 0
    for module in patcher.model.modules():
        for fn in getattr(module, "weight_function", []) or []:
            if isinstance(fn, comfy.model_patcher.LowVramPatch):
                count += 1
    return count


@contextlib.contextmanager
def recording_lowvram_patches():
    """Record each call of ComfyUI's LowVramPatch (the lowvram LoRA, run by comfy.ops' cast on
    each use): (weight key, the weight's device type, the weight it was given summed in
    float64). The sum stays a tensor (no host sync inside the forward)."""
    comfy = import_comfyui()
    cls = comfy.model_patcher.LowVramPatch
    original = cls.__call__
    calls: list[tuple[str, str, torch.Tensor]] = []

    def call(self, weight):
        calls.append((self.key, weight.device.type, weight.detach().double().sum()))
        return original(self, weight)

    cls.__call__ = call
    try:
        yield calls
    finally:
        cls.__call__ = original


# ---------------------------------------------------------------------------------------------
# Counting attention calls
# ---------------------------------------------------------------------------------------------

class AttentionCounter:
    """Count H3's attention calls inside the `with` block.

    H3's module imports `optimized_attention` by name; this swaps that name for a wrapper
    built the way ComfyUI builds its own (`wrap_attn` around the same function), so the
    override and preferred-attention conventions behave exactly as without the counter.
    kernel: run this attention function as ComfyUI's default instead (what a startup flag such
    as --use-split-cross-attention or --use-sage-attention makes `optimized_attention` at import).

    entered:    attention call sites reached (refiner blocks and DiT blocks)
    default:    calls of the function ComfyUI would run by default (its `optimized_attention`
                kernel: sub-quadratic on CPU, SDPA on CUDA...), including calls an
                `optimized_attention_override` makes through the `func` it is handed
    preferred:  calls of a preferred attention set with `set_preferred_attention`
    keywords:   the keyword names of each call site's call (`preferred_attention` where the
                release passes one)
    """

    def __init__(self, kernel=None):
        self.entered = 0
        self.default = 0
        self.preferred = 0
        self.keywords: list[frozenset[str]] = []
        self.kernel = kernel
        self._saved = None

    def __enter__(self) -> AttentionCounter:
        comfy = import_comfyui()
        h3 = comfy.ldm.minimax.model
        attention = comfy.ldm.modules.attention
        original = h3.optimized_attention if self.kernel is None else self.kernel
        kernel = getattr(original, "__wrapped__", original)

        @functools.wraps(kernel)
        def counted_kernel(*args, **kwargs):
            self.default += 1
            return kernel(*args, **kwargs)

        wrapped = attention.wrap_attn(counted_kernel)
        wrapped.container_function = getattr(original, "container_function", None)

        def entry(*args, **kwargs):
            self.entered += 1
            self.keywords.append(frozenset(kwargs))
            return wrapped(*args, **kwargs)

        entry.__wrapped__ = counted_kernel
        entry.container_function = wrapped.container_function
        self._saved = (h3, h3.optimized_attention)
        h3.optimized_attention = entry
        return self

    def __exit__(self, *exc) -> None:
        h3, original = self._saved
        h3.optimized_attention = original

    def count_preferred(self, fn):
        """Wrap `fn` so calls of it count in `self.preferred`."""
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.preferred += 1
            return fn(*args, **kwargs)
        return counted


def negated_basic_attention():
    """A startup flag's kernel whose output surely differs from the CPU default: ComfyUI's
    basic attention with its result negated, wrapped as ComfyUI wraps its kernels.

    Basic attention alone can equal the default bit for bit at the tests' sizes on some CPUs
    (sub-quadratic and SDPA then round the same), so a test could not tell which kernel ran.
    Negation flips signs only: a head share of it is exactly the same share of the whole, so
    a sharded run still equals the kernel unpatched, and any call of another kernel shows."""
    comfy = import_comfyui()
    attention = comfy.ldm.modules.attention
    basic = getattr(attention.attention_basic, "__wrapped__", attention.attention_basic)

    def negated_basic(*args, **kwargs):
        return -basic(*args, **kwargs)

    return attention.wrap_attn(negated_basic)


def preferred_attention_missing(patcher) -> str | None:
    """Why this ComfyUI's H3 has no per-module preferred attention, or None when it has one.

    The newest files give each H3 `Attention` a `comfy_attention` (ComfyAttention, set from a
    checkpoint's `comfy_attention.config`) and pass it as `preferred_attention=`; ComfyUI 0.33.0
    has neither: its H3 runs `optimized_attention`, chosen at startup by the flags."""
    if any(hasattr(m, "comfy_attention") for m in patcher.model.diffusion_model.modules()):
        return None
    return ("this ComfyUI's H3 Attention has no per-module ComfyAttention (ComfyUI 0.33.0): "
            "nothing prefers another attention; its optimized_attention (the startup flags' "
            "choice) runs, and the tests of that kernel cover it")


def set_preferred_attention(patcher, fn) -> int:
    """Give every H3 attention module a preferred attention function, as a checkpoint whose
    state dict carries a `comfy_attention.config` does; `fn=None` clears it. Returns the
    number of modules set."""
    count = 0
    for module in patcher.model.diffusion_model.modules():
        comfy_attention = getattr(module, "comfy_attention", None)
        if comfy_attention is not None:
            comfy_attention.function = fn
            count += 1
    return count


def attention_calls_per_forward(config: TinyH3Config) -> int:
    """DiT-forward attention calls (the refiner runs in extra_conds, once per sampling run)."""
    return config.blocks


class CallCounter:
    """Count calls of the DiT blocks' (not the refiner's) linears and record the block input rows.

    Forward pre-hooks fire on every `module(x)` call, whatever replaced the module's forward
    (bypass adapters, chunked blocks calling the linear per row chunk).
    """

    def __init__(self, patcher, names: tuple[str, ...] = ("attn.qkv_proj", "attn.out_proj",
                                                          "mlp.fc1", "mlp.fc2")):
        self.blocks = patcher.model.diffusion_model.blocks
        self.names = names
        self.calls = {name: 0 for name in names}
        self.rows: list[int] = []  # block input rows, one entry per block call
        self._handles: list = []

    def __enter__(self) -> CallCounter:
        def counter(name):
            def hook(module, args):
                self.calls[name] += 1
            return hook

        def rows(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            self.rows.append(int(x.shape[0]))

        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(rows, with_kwargs=True))
            for name in self.names:
                module = block.get_submodule(name)
                self._handles.append(module.register_forward_pre_hook(counter(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def per_block(self, name: str) -> float:
        return self.calls[name] / max(len(self.rows), 1)


def kernels_row_and_head_independent(patcher, tokens: int, *, ffn_chunk: int, qkv_chunk: int,
                                     head_group: int, rank: int = 0, seed: int = 0) -> bool:
    """Whether this machine's kernels give the same rows chunked as whole, for the DiT's GEMM
    shapes (LoRA rank `rank` included) at these chunk sizes, and the same heads in groups as in
    one attention call (ComfyUI's attention function, called as the chunked block calls it).

    CPU BLAS may split rows over threads or switch micro-kernels by row count (seen: fp32 with
    two MKL threads), so a row-chunked GEMM is not bit-identical everywhere; where it is, the
    whole chunked model must be too.
    """
    import torch.nn.functional as F

    from h3_multigpu.chunking.sizing import head_groups, row_chunks

    block = patcher.model.diffusion_model.blocks[0]
    dtype = block.attn.qkv_proj.weight.dtype
    hidden, heads, dim = block.attn.qkv_proj.in_features, block.attn.heads, block.attn.head_dim
    inner, ffn = heads * dim, block.mlp.fc2.in_features
    gen = torch.Generator().manual_seed(seed)

    def rows_independent(k: int, n: int, chunk: int) -> bool:
        x = torch.randn((tokens, k), generator=gen).to(dtype)
        w = (torch.randn((n, k), generator=gen) / k ** 0.5).to(dtype)
        whole = F.linear(x, w)
        return all(torch.equal(F.linear(x[a:b], w), whole[a:b])
                   for a, b in row_chunks(tokens, chunk))

    shapes = []
    if qkv_chunk:
        shapes += [(hidden, 3 * inner, qkv_chunk), (inner, hidden, qkv_chunk)]
    if ffn_chunk:
        shapes += [(hidden, 2 * ffn, ffn_chunk), (ffn, hidden, ffn_chunk)]
    if rank:
        shapes += [(k, rank, c) for k, _, c in shapes] + [(rank, n, c) for _, n, c in shapes]
    if not all(rows_independent(k, n, c) for k, n, c in shapes):
        return False
    groups = head_groups(heads, head_group, tokens)
    if len(groups) <= 1:
        return True
    # the function ComfyUI hands an attention override (the head-group override calls it per
    # group): `optimized_attention` as H3 imported it, unwrapped
    h3 = sys.modules[type(block).__module__]
    func = getattr(h3.optimized_attention, "__wrapped__", h3.optimized_attention)
    qkv = torch.randn((tokens, 3 * heads * dim), generator=gen).to(dtype)
    q, k, v = (t.view(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
               for t in qkv.split(inner, dim=-1))
    whole = func(q, k, v, heads, mask=None, skip_reshape=True)
    return all(torch.equal(func(q[:, a:b], k[:, a:b], v[:, a:b], b - a, mask=None,
                                skip_reshape=True), whole[..., a * dim:b * dim])
               for a, b in groups)


class RowByRowFunctional:
    """torch.nn.functional with `linear` run on one row per call (`adapter_gemms_row_by_row`)."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        self.calls += 1
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return torch.nn.functional.linear(x, weight, bias)
        out = torch.cat([torch.nn.functional.linear(rows[i:i + 1], weight, bias)
                         for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def adapter_gemms_row_by_row():
    """ComfyUI's LoRA adapter (`comfy.weight_adapter.lora`, its bypass `h`: F.linear down, then
    up, in the activations' dtype) with each of its GEMMs called one row at a time, for every
    run inside (unpatched and the pack's alike); everything else, ComfyUI's INT8 kernel
    included, runs as it is. Upstream's adapter code runs unchanged: only the BLAS call sees one
    row, so its reduction order cannot depend on the row count. What for: a CPU whose fp32
    GEMM of a rank-4 output picks its kernel by M (seen: MKL, 2 threads, 1024->4: 17- and
    25-row slices of a 50-row call differ in the last bit) makes no row split equal the whole
    call, the pack's or any; pinned, the comparison still proves that the pack runs upstream's
    modules on the right rows. Yields the stand-in (`calls`: its linear ran)."""
    lora = importlib.import_module("comfy.weight_adapter.lora")
    if getattr(lora, "F", None) is not torch.nn.functional:
        raise ComfyUIUnavailable("comfy.weight_adapter.lora does not call torch.nn.functional "
                                 "as F here: its adapter GEMMs cannot be pinned")
    pinned = RowByRowFunctional()
    lora.F = pinned
    try:
        yield pinned
    finally:
        lora.F = torch.nn.functional


def checksum(*tensors: torch.Tensor) -> float:
    """A float64 sum of |x| * (index + 1) over the tensors: changes when any element does."""
    total = 0.0
    for t in tensors:
        flat = t.detach().to(torch.float64).flatten().abs()
        total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def record_cuda_pin_calls(monkeypatch) -> dict[int, int]:
    """ComfyUI's pinning on with an empty budget, CUDA's host-registration calls recorded (ComfyUI's
    own pin_memory / unpin_memory and their bookkeeping run): the registered pointer -> bytes."""
    import comfy.model_management as mm

    registered: dict[int, int] = {}

    class CudaRuntime:
        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            assert ptr not in registered
            registered[ptr] = size
            return 0

        @staticmethod
        def cudaHostUnregister(ptr):
            registered.pop(ptr)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: CudaRuntime)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
    monkeypatch.setattr(mm, "PINNED_MEMORY", {})
    return registered
