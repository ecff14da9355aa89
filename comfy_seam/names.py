"""Every ComfyUI name the pack uses, spelled once.

The values are ComfyUI's own (checked on ComfyUI 0.33.0 and the newest-files bed, see
`internals.INTERNALS`, which a `comfyui` test resolves on each release). They are spelled out
so the library, the twin and the CPU tests import without ComfyUI; the pack's own keys (what it
registers its hooks under) live here too, so no feature re-spells another's.
"""

from __future__ import annotations

# ------------------------------------------------ model_options / transformer_options
TRANSFORMER_OPTIONS = "transformer_options"  # model_options key of the per-forward options
OVERRIDE_KEY = "optimized_attention_override"  # attention override (wrap_attn reads it)
PATCHES_REPLACE = "patches_replace"  # transformer_options key of the block-replace patches
DIT_PATCH = "dit"  # the H3 model's patches_replace group (comfy/ldm/minimax/model.py)
DOUBLE_BLOCK = "double_block"  # the H3 block-replace key: ("double_block", i)
# the arguments of an H3 block-replace patch: (args, extra) -> {BLOCK_IMG: new h}
BLOCK_IMG = "img"  # args: the residual stream h [S, C]; the patch's result: the new h
BLOCK_T_EMB = "t_emb"  # args: the timestep embedding (one row per modulation row group)
BLOCK_SEGMENTS = "mod_segments"  # args: (start, stop, modulation row) ranges of the token rows
BLOCK_ROPE = "rope_freqs"  # args: the RoPE rotation table, one row per token
BLOCK_ATTENTION = "attention"  # args (newest files): an attention module passed to the block
ORIGINAL_BLOCK = "original_block"  # extra: upstream's block as a patch-style call
SELECT_BASE_DEVICE = "_select_base_load_device"  # Select*Device: the loader's device
MULTIGPU_CLONES = "multigpu"  # additional-models key of ComfyUI's CFG-split per-GPU clones
PREFETCH_DYNAMIC_VBARS = "prefetch_dynamic_vbars"  # DynamicVRAM's per-call block prefetch flag

# ---------------------------------------------------------------- object patches
VAE_DECODE_LOOP = "decode_temporal"  # the upstream H3 video VAE's window loop (object patch)

# ---------------------------------------------------------------- comfy.patcher_extension
# WrappersMP values
OUTER_SAMPLE = "outer_sample"
PREPARE_SAMPLING = "prepare_sampling"
DIFFUSION_MODEL = "diffusion_model"
# CallbacksMP values
ON_LOAD = "on_load_after"
ON_DETACH = "on_detach_after"
ON_CLEANUP = "on_cleanup"
ON_APPLY_HOOKS = "on_apply_hooks"

# ---------------------------------------------------------------- the pack's own keys
STATUS_KEY = "h3_multigpu"  # transformer_options key: {feature: status line}
SEAM_KEY = "h3_multigpu.seam"  # transformer_options key: what the seam installed (a tuple)
PARALLEL_KEY = "h3_multigpu_parallel"  # per-forward mode the sequence mode writes, Dual-Sage reads
GUARD_KEY = "h3_multigpu.device_guard"
OOM_GUARD_KEY = "h3_multigpu.oom_guard"
PREFETCH_KEY = "h3_multigpu.prefetch"
DUAL_SAGE_KEY = "h3_multigpu_dual_sage"
SEQUENCE_KEY = "h3_multigpu.sequence"
CHUNKING_KEY = "h3_multigpu.chunking"
DECODE_KEY = "h3_multigpu.decode"
ATTENTION_KEY = "h3_multigpu.attention"
CLONES_KEY = "h3_multigpu_sequence"  # additional-models key of the sequence helper clones
REBIND = "h3_multigpu_rebind"  # an object patch that can move to a helper clone's module
