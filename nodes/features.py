"""Apply Dual-Sage, chunking and prefetch to a model, from a plan or from node inputs.

Thin glue: the configs and apply functions live in `dual_sage/`, `chunking/`, `offload/`.
Each is imported when used; a module that is missing or fails to import leaves the model
unchanged and the returned line says so (never a silent no-op). A config the library
refuses (ValueError) propagates: the user sees the message on the node.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..guard.composition import check_cfg_split
from ..guard.device import guard_diffusion_model
from .inputs import parse_auto_int, parse_bytes, parse_int, shown
from .placement import Placement
from .status import feature_lines


class FeatureUnavailable(RuntimeError):
    """The library module behind a feature is not importable in this install."""


def _load(module: str, *names: str) -> tuple[Any, ...]:
    try:
        mod = importlib.import_module(f"..{module}", __package__)
        return tuple(getattr(mod, n) for n in names)
    except (ImportError, AttributeError) as exc:
        raise FeatureUnavailable(f"{module} is not available in this install ({exc})") from exc


def dual_sage_config(*, helpers: str, split: str, backend: str = "comfyui",
                     min_tokens: str = "auto", exact_only: bool = True):
    (config_cls,) = _load("dual_sage", "DualSageConfig")
    return config_cls.from_strings(helpers=helpers, split=split, backend=backend,
                                   min_tokens=min_tokens, exact_only=exact_only)


def chunking_config(*, ffn_chunk: str, qkv_chunk: str = "auto", head_group: str = "auto"):
    (config_cls,) = _load("chunking", "ChunkingConfig")
    return config_cls.from_strings(ffn_chunk=ffn_chunk, qkv_chunk=qkv_chunk,
                                   head_group=head_group)


def prefetch_config(*, resident_blocks: str, lookahead: str | int = 2,
                    pinned_budget: str = "auto"):
    (config_cls,) = _load("offload", "PrefetchConfig")
    return config_cls(resident_blocks=parse_auto_int(resident_blocks, "resident_blocks"),
                      lookahead=parse_int(lookahead, "lookahead", minimum=1),
                      pinned_budget_bytes=parse_bytes(pinned_budget, "pinned_budget"))


def sequence_config(*, parallel: str = "auto", helpers: str = "auto", split: str = "auto"):
    (config_cls,) = _load("sequence", "SequenceParallelConfig")
    if not isinstance(helpers, str):
        raise ValueError(f"helpers={shown(helpers)} must be text such as 'gpu:0,gpu:2' or "
                         "'auto'")
    names = None if helpers.strip().lower() in ("", "auto") else tuple(
        p.strip() for p in helpers.split(",") if p.strip())
    return config_cls(parallel=parallel, helpers=names, split=split)


CONFIGS = {"dual_sage": dual_sage_config, "chunking": chunking_config,
           "prefetch": prefetch_config, "sequence": sequence_config}
APPLY = {"dual_sage": ("dual_sage", "apply_dual_sage"),
         "chunking": ("chunking", "apply_activation_chunking"),
         "prefetch": ("offload", "apply_block_prefetch"),
         "sequence": ("sequence", "apply_sequence_parallel")}


def check_options(feature: str, **options) -> str | None:
    """validate_inputs helper: the library's own parse of the node's strings (None = fine).

    Inputs that are still links arrive as None and are left to run time.
    """
    if any(v is None for v in options.values()):
        return None
    try:
        CONFIGS[feature](**options)
    except ValueError as exc:
        return str(exc)
    except FeatureUnavailable:
        return None  # said at run time, on the status output
    return None


def apply_feature(model: Any, feature: str, config: Any) -> Any:
    """The feature's apply function, then the DiT device guard on its clone (idempotent)."""
    module, name = APPLY[feature]
    (apply,) = _load(module, name)
    check_cfg_split(model, (feature,), config)  # ComfyUI's CFG Split came before the pack
    patched = apply(model, config)
    if patched is not model:
        guard_diffusion_model(patched)
    return patched


def apply_from_strings(model: Any, feature: str, **options) -> Any:
    return apply_feature(model, feature, CONFIGS[feature](**options))


def _plan_config(feature: str, plan: Any, options: dict[str, str]) -> Any:
    """The plan's settings as the library's config (its from_plan where it has one)."""
    module = {"chunking": ("chunking", "ChunkingConfig"),
              "prefetch": ("offload", "PrefetchConfig")}.get(feature)
    if module is not None:
        (config_cls,) = _load(*module)
        if hasattr(config_cls, "from_plan"):
            return config_cls.from_plan(getattr(plan, feature))
    if feature == "sequence":
        (from_plan,) = _load("sequence", "config_from_plan")
        return from_plan(plan, parallel=options["parallel"])
    return CONFIGS[feature](**options)


def plan_feature_strings(plan: Any) -> dict[str, dict[str, str] | str]:
    """What the plan asks of each feature, as the strings the configs parse.

    A feature the plan leaves off maps to the reason (a str) instead of its options.
    """
    out: dict[str, dict[str, str] | str] = {}
    dual = plan.dual_sage
    if dual.enabled:
        out["dual_sage"] = {
            "helpers": ",".join(f"gpu:{i}" for i in dual.helper_devices),
            "split": ":".join(str(h) for h in dual.split),
            "backend": "comfyui",  # ComfyUI's own attention, sharded: exact by default
            "min_tokens": str(dual.min_tokens),
        }
    else:
        out["dual_sage"] = f"off: {dual.reason}"
    chunks = plan.chunking
    if chunks.ffn_chunk or chunks.qkv_chunk or chunks.head_group:
        out["chunking"] = {"ffn_chunk": str(chunks.ffn_chunk), "qkv_chunk": str(chunks.qkv_chunk),
                           "head_group": str(chunks.head_group)}
    else:
        out["chunking"] = f"off: {chunks.reason}"
    pre = plan.prefetch
    if getattr(pre, "streamer", "pack") == "comfyui":
        # ComfyUI's DynamicVRAM streams (or holds) the DiT: the pack's streamer stays out
        out["prefetch"] = f"off: {pre.reason}"
    elif pre.streamed_blocks:
        out["prefetch"] = {"resident_blocks": str(pre.resident_blocks),
                           "lookahead": str(pre.lookahead),
                           "pinned_budget": str(pre.pinned_budget_bytes)}
    else:
        out["prefetch"] = f"off: {pre.reason}"
    parallel = getattr(plan, "parallel", None)
    if parallel is not None and parallel.sequence_used:
        order = parallel.sequence_devices([plan.root_device, *plan.helper_devices])
        forced = parallel.requested in ("sequence", "cfg_sequence")
        out["sequence"] = {"parallel": "sequence" if forced else "auto",
                           "helpers": ",".join(f"gpu:{i}" for i in order[1:]),
                           "split": ":".join(f"{w:g}" for w in parallel.row_weights[:len(order)])}
    elif parallel is not None:
        why = "; ".join(f"{n.upper()} {p.mode}: {p.reason}" for n, p in parallel.passes.items())
        out["sequence"] = f"off: {why}"
    return out


def dual_sage_for_placement(options: dict[str, str], plan: Any, placement: Placement
                            ) -> dict[str, str]:
    """The plan's Dual-Sage options for the GPUs the placement really uses.

    The DiT runs on `placement.root` and the placement's helper is Dual-Sage's first helper:
    the Advanced node's root_gpu/helper_gpu overrides (a role swap, another helper of 3+ GPUs)
    replace the plan's. The plan's other helpers stay unless one of them is now the root. The
    plan's head split follows its devices (its counts read as throughputs; 'auto' when a device
    is new to the plan).
    """
    dual = plan.dual_sage
    plan_devices = [getattr(plan, "root_device", None), *dual.helper_devices]
    helpers = [placement.helper, *(h for h in dual.helper_devices
                                   if h not in (placement.root, placement.helper))]
    devices = [placement.root, *helpers]
    if devices == plan_devices:
        return options
    share = dict(zip(plan_devices, dual.split, strict=False))
    split = "auto" if any(d not in share for d in devices) else \
        ":".join(f"{float(share[d]):.1f}" for d in devices)
    return {**options, "helpers": ",".join(f"gpu:{i}" for i in helpers), "split": split}


def apply_plan(model: Any, plan: Any, placement: Placement,
               disabled: tuple[str, ...] = ()) -> tuple[Any, dict[str, str]]:
    """Apply every feature the plan enables; return the model and one line per feature.

    Order: Dual-Sage, chunking, prefetch, then the sequence mode, whose block patches wrap the
    prefetcher's and which decides per step whether Dual-Sage or it runs.
    """
    lines: dict[str, str] = {}
    wanted = plan_feature_strings(plan)
    for name in ("dual_sage", "sequence"):
        if not placement.multi_gpu and isinstance(wanted.get(name), dict):
            wanted[name] = "off: only one GPU is in use here"
    if isinstance(wanted.get("dual_sage"), dict):
        wanted["dual_sage"] = dual_sage_for_placement(wanted["dual_sage"], plan, placement)
    if "prefetch" in wanted:
        wanted["prefetch"] = _prefetch_for_loader(model, plan, wanted["prefetch"])
    for name, options in wanted.items():
        if name in disabled:
            lines[name] = "off: switched off on the node"
        elif isinstance(options, str):
            lines[name] = options
        else:
            try:
                model = apply_feature(model, name, _plan_config(name, plan, options))
                lines[name] = "applied (the library recorded no status line)"
            except FeatureUnavailable as exc:
                lines[name] = f"NOT ACTIVE: {exc}"
    model, cfg_line = _cfg_split_for_plan(model, plan, placement)
    recorded = feature_lines(model)
    for name, line in recorded.items():
        if name not in lines or lines[name].startswith("applied"):
            lines[name] = line  # the library's own words win for what it applied
    if cfg_line is not None:
        lines["cfg_split"] = cfg_line
    return model, lines


def _cfg_split_for_plan(model: Any, plan: Any, placement: Placement) -> tuple[Any, str | None]:
    """Where the plan runs a pass as CFG split (above CFG 1, `planner.cfg_split`), ComfyUI's own
    MultiGPU CFG Split set up on the model, as its node does (after the placement, so core's
    extra GPU is the one beside the root); the pack's split features are off in such a plan.
    None when no pass is planned so (no line: nothing to say at CFG 1)."""
    from ..comfy_seam import clones

    passes = getattr(getattr(plan, "parallel", None), "passes", {}) or {}
    split = [name.upper() for name, p in passes.items() if p.mode in ("cfg", "cfg_sequence")]
    if not split:
        return model, None
    where = ", ".join(split)
    if not placement.multi_gpu:
        return model, f"off: only one GPU is in use here (the plan splits CFG in {where})"
    try:
        split_model = clones.apply_cfg_split(model, 2)
    except RuntimeError as exc:
        return model, (f"NOT ACTIVE: {exc}; {where} run cond and uncond one after the other "
                       "on the root")
    devices = clones.cfg_split_devices(split_model)
    if len(devices) < 2:
        return model, ("NOT ACTIVE: ComfyUI set up no copy (its device list has no GPU "
                       f"besides {getattr(model, 'load_device', '?')}); {where} run both calls "
                       "on the root")
    return split_model, (f"ComfyUI's MultiGPU CFG Split (max_gpus 2): cond and uncond one a "
                         f"GPU on {', '.join(str(d) for d in devices)}, its copy from the "
                         f"loader's factory; the plan splits CFG in {where}")


def _prefetch_for_loader(model: Any, plan: Any, wanted: dict[str, str] | str
                         ) -> dict[str, str] | str:
    """The prefetch entry for the loader this model really runs with: a DynamicVRAM model is
    streamed by ComfyUI (its line says how), and a plan that left streaming to DynamicVRAM
    cannot stream a legacy model."""
    from ..comfy_seam.memory import dynamic_vram_line, is_dynamic

    pre = plan.prefetch
    if is_dynamic(model):
        planned = (f"plan: {pre.resident_blocks} of 50 blocks resident, {pre.streamed_blocks} "
                   "cast in per step" if getattr(pre, "streamer", "pack") == "comfyui" else
                   "the plan was made for the legacy loader: plan with devices 'auto' here")
        return ("off: ComfyUI's DynamicVRAM streams this model's weights, the block prefetcher "
                f"stands aside; {dynamic_vram_line(model)}; {planned}")
    if getattr(pre, "streamer", "pack") == "comfyui" and pre.streamed_blocks:
        return ("NOT ACTIVE: the plan leaves the DiT's streaming to ComfyUI's DynamicVRAM, but "
                "this model loads with the legacy ModelPatcher, so nothing would stream "
                f"{pre.streamed_blocks} blocks: plan with devices 'auto' in this ComfyUI (or "
                "dynamic_vram off)")
    return wanted


def apply_decode_plan(vae: Any, plan: Any, vae_gpu: int | None) -> tuple[Any, str]:
    """The plan's video-decode decision carried out on the placed video VAE (on gpu:vae_gpu):
    the VAE patched to share its windows with the plan's other decode GPUs, or unchanged with
    the reason it decodes on one GPU."""
    decision = getattr(plan, "decode", None)
    if decision is None:
        return vae, "NOT ACTIVE: no plan"
    if not decision.multi or vae_gpu is None:
        return vae, f"off: {decision.describe()}"
    helpers = [g for g in decision.devices if g != vae_gpu]
    gpus = getattr(getattr(plan, "profile", None), "gpus", ())
    speeds = None
    if all(0 <= g < len(gpus) for g in (vae_gpu, *helpers)):
        speeds = tuple(gpus[g].matmul_tflops for g in (vae_gpu, *helpers))
    try:
        config_cls, apply = _load("decode", "MultiGPUDecodeConfig", "apply_multi_gpu_decode")
        config = config_cls(helpers=tuple(f"cuda:{g}" for g in helpers), shares=speeds,
                            make_room=decision.make_room)
        patched, line = apply(vae, config)
    except (FeatureUnavailable, ValueError) as exc:
        return vae, f"NOT ACTIVE: {exc}"
    return patched, f"{line}; plan: {decision.describe()}"
