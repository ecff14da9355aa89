"""Stage 1 of a plan: the request, checked at construction (every refusal names the value and
the fix, before anything is planned or loaded)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..common import geometry
from .hardware import ATTENTION_KERNELS, QUANTIZED_ATTENTION, HardwareProfile
from .residency import RESIDENT_NEEDS_LEGACY

PARALLEL_MODES = ("auto", "sequence", "heads", "cfg", "cfg_sequence", "off")
MAX_CFG = 100.0  # ComfyUI's KSampler/CFGGuider cfg input ends there
ATTENTIONS = ("auto", *ATTENTION_KERNELS)
MAX_STEPS = 200
# the DiT linears' weight format (`comfy_seam.h3.weight_format`'s names) of each dit_dtype: "int8"
# is the official pruned file, INT8 ConvRot
DIT_WEIGHT_FORMATS = {"int8": "int8_convrot", "bf16": "bfloat16"}


@dataclass(frozen=True)
class PlanRequest:
    width: int = 1312  # PASS2 canvas
    height: int = 736
    seconds: float | None = 5.0
    frames: int | None = None  # overrides seconds when given (must be on the 17k+5 grid)
    pass1_width: int = 864
    pass1_height: int = 480
    profile: str | HardwareProfile = "auto"
    text_tokens: int = 256
    lora_rank: int = 128  # on-activation LoRA (the turbo LoRA); 0 = none
    dit_dtype: str = "int8"  # "int8" (official pruned file) or "bf16"
    dit_file: str | None = None  # read real block sizes from this checkpoint's header
    dual_sage: str = "auto"  # "auto" | "on" | "off"
    parallel: str = "auto"  # per pass: one of PARALLEL_MODES
    decode: str = "auto"  # video decode on several GPUs: "auto" | "on" | "off"
    chunking: str = "auto"  # "auto" | "off" | "on"
    resident_blocks: int | None = None  # None = as many as fit
    # the attention kernel ComfyUI runs: "auto" (inside ComfyUI what it would run; on the
    # command line ComfyUI's default, SDPA, or what the checkpoint prefers), "sdpa", "flash",
    # "sage" (--use-sage-attention) or "ck" (--use-ck-attention)
    attention: str = "auto"
    quantized_attention: bool = False  # the old flag: attention "sage" (kept as an alias)
    pinned_fraction: float = 0.5  # share of host RAM the pinned arena may take
    # ComfyUI's DynamicVRAM loader: "auto" (on for NVIDIA, ROCm 7.14+), "on" or "off" (the
    # legacy loader: ROCm below 7.14, --disable-dynamic-vram, --highvram, --gpu-only, ...)
    dynamic_vram: str = "auto"
    # page-lockable host memory: ComfyUI's pin budget inside ComfyUI (MAX_PINNED_MEMORY); None
    # = pinned_fraction of the profile's RAM
    pinned_budget_bytes: int | None = None
    pass1_steps: int = 8  # the bundled workflows: 8 turbo steps, then 4 refining steps
    pass2_steps: int = 4
    # the guidance scale of each pass: at 1 (the turbo LoRA's, the bundled workflows') ComfyUI
    # runs one model call per step; above 1 two (cond and uncond), which CFG Split can share
    pass1_cfg: float = 1.0
    pass2_cfg: float = 1.0

    def __post_init__(self) -> None:
        # numpy integers (a width read from an array) are accepted and stored as ints
        for name in ("width", "height", "pass1_width", "pass1_height", "text_tokens",
                     "lora_rank", "pass1_steps", "pass2_steps"):
            object.__setattr__(self, name, geometry.as_int(getattr(self, name), name))
        for name in ("frames", "resident_blocks"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, geometry.as_int(getattr(self, name), name))
        geometry.validate_two_pass(self.pass1_width, self.pass1_height, self.width, self.height)
        if self.frames is None and self.seconds is None:
            raise ValueError("give seconds or frames for the clip length")
        if self.frames is not None:
            geometry.validate_frames(self.frames)
        else:
            geometry.snap_frames(self.seconds)
        if self.dit_dtype not in DIT_WEIGHT_FORMATS:
            raise ValueError(f"dit_dtype {self.dit_dtype!r} is not known; use 'int8' or 'bf16'")
        for name in ("dual_sage", "chunking", "decode", "dynamic_vram"):
            value = getattr(self, name)
            allowed = ("auto", "on", "off")
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not valid; use one of {allowed}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={self.parallel!r} is not valid; use one of "
                             f"{PARALLEL_MODES}")
        self._check_attention()
        for name in ("pass1_cfg", "pass2_cfg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0.0 <= value <= MAX_CFG:
                raise ValueError(f"{name}={value!r} must be a guidance scale from 0 to "
                                 f"{MAX_CFG:g} (1 = the turbo LoRA's, one model call a step)")
            object.__setattr__(self, name, float(value))
        for name, high, why in (
                ("lora_rank", geometry.HIDDEN, "the DiT's width; the turbo LoRA's rank is 128"),
                ("text_tokens", geometry.MAX_TEXT_TOKENS,
                 "far more than any prompt; H3 prompts take a few hundred tokens"),
                ("pass1_steps", MAX_STEPS, "H3 samples in 8 (turbo) to 50 steps"),
                ("pass2_steps", MAX_STEPS, "a PASS2 refines in a few steps")):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (0 = none)")
            if value > high:
                raise ValueError(f"{name}={value} is larger than {high} ({why})")
        if self.pass1_steps + self.pass2_steps == 0:
            raise ValueError("pass1_steps=0 and pass2_steps=0: the job samples nothing; give "
                             "the steps of at least one pass (--steps 8,4)")
        if self.resident_blocks is not None and not 0 <= self.resident_blocks <= geometry.BLOCKS:
            raise ValueError(f"resident_blocks={self.resident_blocks} must be between 0 and "
                             f"{geometry.BLOCKS}")
        if not (isinstance(self.pinned_fraction, (int, float))
                and 0.0 < self.pinned_fraction <= 0.9):
            raise ValueError(f"pinned_fraction={self.pinned_fraction} must be in (0, 0.9]")
        budget = self.pinned_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                   or budget < 0):
            raise ValueError(f"pinned_budget_bytes={budget!r} must be a byte count >= 0 (0 = "
                             "nothing pinned) or None (pinned_fraction of the host RAM)")
        if self.resident_blocks is not None and self.dynamic_vram == "on":
            raise ValueError(RESIDENT_NEEDS_LEGACY.format(n=self.resident_blocks, why="requested"))
        if self.dit_file is not None and not isinstance(self.dit_file, (str, os.PathLike)):
            raise ValueError(f"dit_file={self.dit_file!r} must be a path to a .safetensors file")

    def _check_attention(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r} is not valid; use one of "
                             f"{ATTENTIONS}")
        if not self.quantized_attention:
            return
        # the old flag names an INT8-QK kernel: sage unless another quantized one is named
        if self.attention == "auto":
            object.__setattr__(self, "attention", "sage")
        elif self.attention not in QUANTIZED_ATTENTION:
            raise ValueError(f"quantized_attention=True asks for an INT8-QK kernel but "
                             f"attention={self.attention!r} is not one; drop "
                             f"--quantized-attention or use --attention sage (or ck)")

    def model_calls(self, name: str) -> int:
        """Model calls per sampling step of pass `name`: ComfyUI skips the uncond at CFG 1
        (samplers.cfg_function's cfg1 optimization), so a step is one call there, else two."""
        return 1 if math.isclose(getattr(self, f"{name}_cfg"), 1.0) else 2

    @property
    def dit_weight_format(self) -> str:
        return DIT_WEIGHT_FORMATS[self.dit_dtype]

    @property
    def frame_count(self) -> int:
        return self.frames if self.frames is not None else geometry.snap_frames(self.seconds)
