"""Every ComfyUI name and internal the pack relies on, with where and the releases checked.

One `Internal` per thing the pack reads, calls, patches or assumes. `check(entry)` resolves it
in the ComfyUI this process imports: an attribute (module path + attribute chain), a value
(an attribute equal to the one `names` spells), a parameter (a callable's parameter at an
index) or a source fact (a module's source contains a piece of text: how a call is made, a key
read). `tests/test_comfy_seam_comfyui.py` checks every entry on each bed (ComfyUI 0.33.0 and the
newest-files bed, upstream model.py @01a56b76); `releases` names where each was checked, and an
entry only one of them has says so ("newest": the newest files only).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from . import core_nodes, files, interrupts, names, vae

BOTH = ("0.33.0", "newest")
NEWEST = ("newest",)
RELEASE_033 = ("0.33.0",)


@dataclass(frozen=True)
class Internal:
    target: str  # "module:attr.attr" (attr/value/param) or "module" (source)
    kind: str = "attr"  # "attr" | "value" | "param" | "source"
    expect: Any = None  # value: the value; param: (index, name); source: a text
    used_by: str = ""  # the seam function (or feature) that relies on it
    releases: tuple[str, ...] = BOTH


def _i(target, kind="attr", expect=None, used_by="", releases=BOTH) -> Internal:
    return Internal(target, kind, expect, used_by, releases)


MP = "comfy.model_patcher:ModelPatcher"
H3 = "comfy.ldm.minimax.model"
MM = "comfy.model_management"
VAE_MODULE = "comfy.ldm.minimax.vae"
VAE = f"{VAE_MODULE}:MiniMaxH3VideoVAE"

INTERNALS: tuple[Internal, ...] = (
    # ---- wrapper / callback types (names.py spells them)
    _i("comfy.patcher_extension:WrappersMP.OUTER_SAMPLE", "value", names.OUTER_SAMPLE, "protocol"),
    _i("comfy.patcher_extension:WrappersMP.PREPARE_SAMPLING", "value", names.PREPARE_SAMPLING,
       "protocol"),
    _i("comfy.patcher_extension:WrappersMP.DIFFUSION_MODEL", "value", names.DIFFUSION_MODEL,
       "protocol"),
    _i("comfy.patcher_extension:CallbacksMP.ON_LOAD", "value", names.ON_LOAD, "protocol"),
    _i("comfy.patcher_extension:CallbacksMP.ON_DETACH", "value", names.ON_DETACH, "protocol"),
    _i("comfy.patcher_extension:CallbacksMP.ON_CLEANUP", "value", names.ON_CLEANUP, "protocol"),
    _i("comfy.patcher_extension:CallbacksMP.ON_APPLY_HOOKS", "value", names.ON_APPLY_HOOKS,
       "protocol"),
    # ---- the patcher API the protocol calls, and the attributes it reads
    _i(f"{MP}.clone", used_by="protocol.remove, every apply_*"),
    _i(f"{MP}.add_wrapper_with_key", used_by="protocol.install"),
    _i(f"{MP}.remove_wrappers_with_key", used_by="protocol.remove (through the table)"),
    _i(f"{MP}.add_callback_with_key", used_by="protocol.install"),
    _i(f"{MP}.remove_callbacks_with_key", used_by="protocol.remove"),
    _i(f"{MP}.set_model_patch_replace", used_by="protocol.install (block patches)"),
    _i(f"{MP}.add_object_patch", used_by="protocol.install (object patches)"),
    _i(f"{MP}.get_model_object", used_by="chunking, prefetch, guard"),
    _i(f"{MP}.is_dynamic", used_by="memory.is_dynamic, sequence"),
    _i("comfy_extras.nodes_multigpu", "source", names.SELECT_BASE_DEVICE,
       "clones.select_device_choice (a Select*Device node's choice)", releases=("0.33.0",)),
    _i(f"{MP}.get_additional_models_with_key",
       used_by="clones.cfg_split_devices (MultiGPU CFG Split's clones)"),
    _i("comfy.model_patcher", "source", "is_multigpu_base_clone",
       "clones.cfg_split_devices (a CFG-split clone, not a placed copy)"),
    _i(f"{MP}.get_free_memory", used_by="memory.free_vram_bytes"),
    _i("comfy.model_patcher", "source", "self.wrappers", "protocol.wrapper_table"),
    _i("comfy.model_patcher", "source", "self.object_patches", "protocol.object_patches"),
    _i("comfy.model_patcher", "source", "cached_patcher_init", "nodes.model_check.model_file"),
    _i("comfy.model_patcher:CoreModelPatcher", used_by="models.patcher_class (nodes.v3_upscale)"),
    _i("comfy.model_patcher:LowVramPatch", used_by="tests (lowvram LoRA)"),
    # ---- keys in model_options / transformer_options
    _i("comfy.ldm.modules.attention", "source", f'"{names.OVERRIDE_KEY}"',
       "protocol.override_of (the attention override wrap_attn reads)"),
    _i("comfy.ldm.modules.attention", "source", "_inside_attn_wrapper",
       "chunking.HeadGroups, dual_sage (override calls)"),
    _i("comfy.ldm.modules.attention:wrap_attn", used_by="tests (AttentionCounter)"),
    _i("comfy.ldm.modules.attention:AttentionTensorContainer", used_by="sequence (H3Ops.wrap)"),
    _i(H3, "source", f'"{names.PATCHES_REPLACE}"', "protocol.block_patch_at"),
    _i(H3, "source", f'get("{names.DIT_PATCH}"', "protocol (the H3 patches_replace group)"),
    _i(H3, "source", f'("{names.DOUBLE_BLOCK}", i)', "protocol.block_patch"),
    _i(H3, "source", '"original_block"', "dual_sage, prefetch, sequence block patches"),
    _i("comfy.model_base", "source", f'"{names.PREFETCH_DYNAMIC_VBARS}"',
       "prefetch (turns ComfyUI's block prefetch off while blocks stream)"),
    _i("comfy.model_prefetch:make_prefetch_queue", used_by="memory.comfy_block_prefetch"),
    # ---- the H3 model: what the chunk wrappers and the block patches rely on
    _i(f"{H3}:MiniMaxH3Model.forward", used_by="h3.forward_options"),
    _i(H3, "source", ".execute(x, timestep, context, transformer_options",
       "h3.forward_options (transformer_options at args[3] of a DIFFUSION_MODEL wrapper)"),
    _i("comfy.patcher_extension", "source", "self.class_obj = class_obj",
       "h3.sampled_patcher (WrapperExecutor.class_obj)"),
    _i("comfy.samplers", "source", "self.model_patcher",
       "h3.sampled_patcher (the CFGGuider's model_patcher)"),
    _i(f"{H3}:DiTBlock.forward", "param", (5, "transformer_options"),
       "chunking (upstream's block runs unchanged)"),
    _i(H3, "source", "self.qkv_proj(x).split(", "chunking (qkv_proj called once on [S, C])"),
    _i(H3, "source", "return self.out_proj(out.squeeze(0))",
       "chunking (out_proj called once on [S, I])"),
    _i(H3, "source", "self.mlp(h)", "chunking (mlp called once on [S, C])"),
    _i(H3, "source", 'comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu")',
       "h3.fused_int8_fc2, sizing (the MLP's kernels)"),
    _i(H3, "source", "optimized_attention(q, k, v, self.heads",
       "chunking.HeadGroups, dual_sage (the call site and its heads)"),
    _i(f"{H3}:optimized_attention",
       used_by="h3.default_attention, runtime.loaded_optimized_attention (the planner)"),
    _i(f"{H3}:Attention", used_by="chunking (heads, head_dim)"),
    _i(H3, "source", "comfy_attention", "h3.preferred_function", NEWEST),
    _i("comfy.ldm.modules.attention:ComfyAttention", used_by="h3.preferred_function",
       releases=NEWEST),
    _i("comfy.ops:linear_input_act", used_by="h3.fused_int8_fc2"),
    _i(f"{MM}:in_training", used_by="h3.in_training (chunking, sequence)"),
    _i(f"{MM}:cast_to", used_by="sequence (H3Ops.norm_weight)"),
    # ---- weights and adapters
    _i("comfy.quant_ops:QuantizedTensor", used_by="h3.weight_format"),
    _i("comfy_kitchen.tensor.base", "source", "_layout_cls",
       "h3.weight_format (comfy-kitchen's QuantizedTensor, which comfy.quant_ops exports)"),
    _i("comfy.quant_ops:QUANT_ALGOS", used_by="h3.quant_algos (nodes.model_check)"),
    _i("comfy.weight_adapter.bypass:BypassForwardHook", used_by="h3.activation_adapter_ranks"),
    _i("comfy.weight_adapter.bypass", "source", "self.original_forward",
       "h3.activation_adapter_ranks"),
    _i("comfy.weight_adapter.bypass", "source", "self.adapter = adapter",
       "h3.activation_adapter_ranks"),
    # ---- the loader (legacy path) the prefetcher hooks
    _i("comfy.model_patcher", "source", "\"set_{}\".format(", "loader.setter_key (set_<param>)"),
    _i("comfy.model_patcher", "source", "return_weight", "loader.setter_key (LowVramPatch)"),
    _i("comfy.model_patcher", "source", "return self.size",
       "loader.set_load_size (ModelPatcher.size, what model_size() returns)"),
    _i("comfy.float:stochastic_rounding", used_by="loader.stochastic_round"),
    # ---- memory, devices, progress
    _i(f"{MM}:get_free_memory", used_by="memory.free_vram_bytes"),
    _i(f"{MM}:get_torch_device", used_by="models.torch_device, memory.comfy_runs_on_cpu"),
    _i(f"{MM}:should_use_fp16", used_by="models.should_use_fp16 (nodes.v3_upscale)"),
    _i(f"{MM}:unet_offload_device", used_by="models.offload_device (nodes.v3_upscale)"),
    _i(f"{MM}:EXTRA_RESERVED_VRAM", used_by="memory.vram_budget"),
    _i("nodes:NODE_CLASS_MAPPINGS", used_by="runtime.comfy_nodes, core_nodes.node_class(es)"),
    _i(f"{MM}:get_all_torch_devices",
       used_by="devices.gpu_count (the GPUs ComfyUI uses; gpu:N is its N-th entry)"),
    _i(f"{MM}:get_total_memory", used_by="models.release"),
    _i(f"{MM}:free_memory", used_by="models.make_room, models.release, clones.ask_to_free"),
    _i(f"{MM}:soft_empty_cache", used_by="models.release, models.empty_cache, guard.oom"),
    _i(f"{MM}:current_loaded_models", used_by="models.release"),
    _i(f"{MP}.is_clone", used_by="models.release"),
    _i(f"{MP}.loaded_size", used_by="models.loaded_bytes (the decode)"),
    _i(f"{MM}:load_models_gpu", used_by="models.load (the decode, nodes.v3_upscale)"),
    _i(f"{MM}:load_models_gpu", "param", (1, "memory_required"), "models.load"),
    _i(f"{MM}:intermediate_device", used_by="models.intermediate_device (the decode)"),
    _i(f"{MM}:throw_exception_if_processing_interrupted",
       used_by="interrupts.raise_if_interrupted"),
    _i(f"{MM}:processing_interrupted", used_by="interrupts.processing_interrupted"),
    _i(f"{MM}:{interrupts.INTERRUPT_EXCEPTION}", used_by="interrupts.is_interrupt (by name)"),
    _i(f"{MM}:resolve_gpu_device_option", used_by="models.resolve_gpu_option"),
    _i(f"{MM}:get_gpu_device_options", used_by="models.gpu_device_options"),
    _i(f"{MM}:pin_memory", used_by="memory.pin_host"),
    _i(f"{MM}:unpin_memory", used_by="memory.unpin_host"),
    _i(f"{MM}:MAX_PINNED_MEMORY", used_by="memory.comfy_pin_budget"),
    _i(f"{MM}:TOTAL_PINNED_MEMORY", used_by="memory.comfy_pin_budget"),
    _i(f"{MM}:NUM_STREAMS", used_by="memory.comfy_block_prefetch"),
    _i("comfy.memory_management:aimdo_enabled", used_by="memory.dynamic_vram_enabled"),
    _i("comfy.utils:ProgressBar", used_by="models.progress_bar (the decode)"),
    _i("comfy.utils:common_upscale", used_by="core_nodes.resize_image"),
    _i("comfy.utils:load_torch_file", used_by="files.load_torch_file"),
    # ---- model folders and node helpers (files.py, core_nodes.py)
    *(_i(f"{files.FOLDER_PATHS}:{name}", used_by="files.model_files, files.model_path")
      for name in ("folder_names_and_paths", "models_dir", "add_model_folder_path",
                   "get_filename_list", "get_full_path_or_raise")),
    _i(f"{core_nodes.NODE_HELPERS}:conditioning_set_values",
       used_by="core_nodes.conditioning_set_values"),
    _i(f"{core_nodes.NODE_HELPERS}:conditioning_set_values", "param", (1, "values"),
       "core_nodes.conditioning_set_values"),
    _i(f"{MP}", used_by="models.patcher_class"),
    _i("comfy.model_patcher:ModelPatcherDynamic.register_load_device",
       used_by="clones._register_load_device (DynamicVRAM)"),
    _i("comfy.model_base:MiniMaxH3", used_by="h3.h3_model_class (nodes.model_check)"),
    # ---- the sequence mode's helper clones (clones.py)
    _i(f"{MP}.deepclone_multigpu", used_by="clones.make_clone, clones.clone_gap"),
    _i("comfy.model_patcher", "source", "if self.cached_patcher_init is None:",
       "clones.retarget, decode.replica.comfy_clone (core refuses without a factory)"),
    _i(f"{MP}.deepclone_multigpu", "param", (1, "new_load_device"), "clones.make_clone"),
    _i(f"{MP}.get_clone_model_override", used_by="clones.match_clone"),
    _i(f"{MP}.set_additional_models", used_by="clones.set_clones"),
    _i(f"{MP}.get_additional_models_with_key", used_by="clones (prepare_sampling loads them)"),
    _i(f"{MP}.remove_additional_models", used_by="clones.make_clone, clones.match_clone"),
    _i(f"{MP}.pre_run", used_by="clones.pre_run"),
    _i(f"{MP}.cleanup", used_by="clones.cleanup"),
    _i("comfy.model_patcher", "source", "self.injections", "clones._rebind_injections"),
    _i("comfy.model_patcher", "source", "self.hook_backup", "clones.match_clone"),
    _i(f"{MP}.clone", "param", (2, "model_override"), "clones.match_clone"),
    _i("comfy.patcher_extension:PatcherInjection", used_by="clones._on_device (inject, eject)"),
    _i("comfy.patcher_extension", "source", "self.inject = inject", "clones._on_device"),
    _i("comfy.weight_adapter.bypass:BypassInjectionManager.create_injections",
       used_by="clones._rebind_injections"),
    _i("comfy.weight_adapter.bypass", "source", "self.adapters", "clones._rebind_injections"),
    _i("comfy.weight_adapter.bypass", "source", "self.hooks", "clones._rebind_injections"),
    # both beds: the newest-files bed keeps 0.33.0's comfy/ package under the newest H3 files
    _i("comfy.multigpu:create_multigpu_deepclones", used_by="clones.apply_cfg_split"),
    _i("comfy.multigpu:create_multigpu_deepclones", "param", (3, "reuse_loaded"),
       "clones.apply_cfg_split"),
    _i(f"{MM}:current_loaded_models", used_by="clones.unload"),
    # sequence parallel inside CFG Split (sequence.cfg_groups): a copy's additional models
    # carried to the copy prepare_sampling rebuilds, root models of a uuid it has left alone
    _i(f"{MP}.match_multigpu_clones", used_by="clones.set_clones (a CFG Split copy's helpers)"),
    _i("comfy.model_patcher", "source",
       "n.additional_models = comfy.patcher_extension.copy_nested_dicts(mm.additional_models)",
       "clones.set_clones (a CFG Split copy keeps its helpers across match_multigpu_clones)"),
    _i("comfy.model_patcher", "source",
       "if orig_add_model.clone_base_uuid not in models_cache:",
       "clones.set_clones (no deep clone of the root's helpers onto a CFG Split copy)"),
    _i("comfy.sampler_helpers", "source", "model.match_multigpu_clones()",
       "sequence.cfg_groups (prepare_sampling rebuilds CFG Split's copies before loading)"),
    _i(H3, "source", "new_class_executor(\n            self._forward,\n            self,",
       "h3.wrapped_module (a DIFFUSION_MODEL wrapper's class_obj is the diffusion model)"),
    _i(f"{MM}:free_memory", "param", (2, "keep_loaded"), "clones.unload"),
            _i(H3, "source", "import comfy.model_management", "h3.in_training"),
    _i("comfy.model_patcher", "source",
       f'get_additional_models_with_key("{names.MULTIGPU_CLONES}")',
       "clones.match_clone (the CFG split's additional-models key, taken off a helper clone)"),
    # ---- the H3 video VAE's window loop (vae.py; the split decode)
    *(_i(f"{VAE}.{name}", used_by="vae.WINDOW_LOOP (decode.executor, decode.release)")
      for name in vae.WINDOW_LOOP),
    *(_i(VAE_MODULE, "source", f"self.{name} =", "vae.WINDOW_ATTRS (decode.windows)")
      for name in vae.WINDOW_ATTRS),
    _i(f"{VAE}.tiled_decode", used_by="vae.INNER (decode.release)"),
    _i(f"{VAE}.split_tiles", used_by="vae.INNER (decode.release)"),
    _i(f"{VAE}._decode_tile_row", used_by="vae.INNER (decode.release)", releases=NEWEST),
    # the newest-files bed serves 0.3.64's comfy_extras, which has no multi-GPU nodes: the pack
    # feature-detects them (runtime.nodes_multigpu() is None there)
    *(_i(f"comfy_extras.nodes_multigpu:{name}.execute", used_by="core_nodes.multigpu_node",
         releases=RELEASE_033)
      for name in ("SelectModelDeviceNode", "SelectCLIPDeviceNode", "SelectVAEDeviceNode")),
    # ---- the H3 block-replace arguments (the sequence split plan)
    *(_i(H3, "source", f'"{key}": {value}', "sequence.plan (the block-replace arguments)")
      for key, value in ((names.BLOCK_IMG, "h"), (names.BLOCK_T_EMB, "t_emb"),
                         (names.BLOCK_SEGMENTS, "mod_segments"), (names.BLOCK_ROPE, "rope_freqs"),
                         (names.TRANSFORMER_OPTIONS, "transformer_options"))),
    _i(H3, "source", f'{{"{names.ORIGINAL_BLOCK}": block_wrap}})["{names.BLOCK_IMG}"]',
       "sequence.plan (the output gathered; the original block in extra)"),
    *(_i(f"{H3}:DiTBlock.forward", "param", (index, name),
         "sequence.plan.BLOCK_ARGS (a helper calls upstream's block positionally)")
      for index, name in ((1, "x"), (2, "t_emb"), (3, "mod_segments"), (4, "rope_freqs"))),
    _i(H3, "source", f'args.get("{names.BLOCK_ATTENTION}")',
       "sequence.plan.NOT_SPLIT (a block handed its own attention is not split)", NEWEST),
    # ---- block kernels (planner and run)
    _i(H3, "source", "skip_reshape=True", "h3.block_kernels (H3's attention output is reshaped "
       "by ComfyUI's attention function)"),
    _i("comfy.ldm.modules.attention", "source",
       "out.transpose(1, 2).reshape(b, -1, heads * dim_head)",
       "h3.block_kernels (the reshape that copies the attention output)"),
)


def check(entry: Internal) -> str | None:
    """None when `entry` holds in the ComfyUI this process imports, else what is wrong."""
    module_name, _, path = entry.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        return f"{module_name} does not import: {exc}"
    if entry.kind == "source":
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError) as exc:
            return f"{module_name}: no source ({exc})"
        return None if entry.expect in text else f"{module_name} no longer has {entry.expect!r}"
    for part in path.split("."):
        if not hasattr(obj, part):
            return f"{entry.target}: no attribute {part!r}"
        obj = getattr(obj, part)
    if entry.kind == "value" and obj != entry.expect:
        return f"{entry.target} is {obj!r}, the pack spells {entry.expect!r}"
    if entry.kind == "param":
        index, name = entry.expect
        params = list(inspect.signature(obj).parameters)
        if len(params) <= index or params[index] != name:
            return f"{entry.target}: parameter {index} is not {name!r} ({params})"
    return None


def release_of_running() -> str:
    """Which bed this process runs: "newest" when the H3 model carries the newest files'
    per-module preferred attention, else "0.33.0"."""
    try:
        text = inspect.getsource(importlib.import_module(H3))
    except (ImportError, OSError):
        return "unknown"
    return "newest" if "ComfyAttention" in text else "0.33.0"
