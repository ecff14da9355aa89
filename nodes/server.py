"""What is true of this server, for the status line: its GPUs and their memory as ComfyUI
budgets it, its loader, the loaded DiT and the graph's sampling passes.

The plan may be for a built-in profile (a machine the user does not have); these facts are
always of the machine the node runs on, so the status can say which is which. Pure Python
except `gather`, which asks torch and ComfyUI (through the seam) once per node run.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..common import geometry
from .devices import GpuInfo

# ComfyUI's sampler nodes: each one in the graph below the pack's node is one sampling pass
SAMPLER_NODES = frozenset({"KSampler", "KSamplerAdvanced", "SamplerCustom",
                           "SamplerCustomAdvanced"})
# latent upscale nodes an H3 two-pass graph may use between its passes, in words
UPSCALE_NODES = {
    "H3MultiGPULatentUpscale": "this pack's H3 Latent Upscale",
    "MiniMaxH3LatentUpscaleWithModel": "core's MiniMaxH3LatentUpscaleWithModel",
    "LatentUpscaleModelApply": "core's latent upscale model",
    "LatentUpscale": "core's Upscale Latent (resampling, not learned)",
    "LatentUpscaleBy": "core's Upscale Latent By (resampling, not learned)",
}
FORMAT_WORDS = {"int8_convrot": "INT8 ConvRot", "int8": "INT8", "fp8": "FP8",
                "nvfp4": "NVFP4", "nvfp4_dynamic": "NVFP4 (dynamic)", "bfloat16": "bf16",
                "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class GraphPasses:
    """The sampling passes and the latent upscale of the graph below the pack's node."""

    samplers: int
    upscale: str | None  # in words, or None when the graph has none

    @property
    def one_pass(self) -> bool:
        return self.samplers <= 1

    def describe(self) -> str:
        if self.samplers == 0:
            return "graph: no sampler below this node"
        if self.samplers == 1:
            return ("graph: one sampling pass"
                    + (f", then {self.upscale}" if self.upscale else ", no latent upscale"))
        between = f" with {self.upscale} between them" if self.upscale else \
            " and no latent upscale"
        return f"graph: {self.samplers} sampling passes{between}"


@dataclass(frozen=True)
class ModelFacts:
    """The loaded DiT as ComfyUI built it."""

    blocks: int
    weight_format: str  # the seam's name ("int8_convrot", "bfloat16", ...)

    @property
    def words(self) -> str:
        return FORMAT_WORDS.get(self.weight_format, self.weight_format)

    @property
    def official_size(self) -> bool:
        return self.blocks == geometry.BLOCKS

    def describe(self) -> str:
        line = f"model: {self.blocks} blocks, {self.words} weights"
        if not self.official_size:
            line += (f" (the official H3 DiT has {geometry.BLOCKS} blocks: the plan's sizes and "
                     f"times are for those {geometry.BLOCKS})")
        return line

    def plan_dtype(self) -> str | None:
        """The planner's dit_dtype for this model ("int8" / "bf16"), None when neither fits."""
        if self.weight_format.startswith("int8"):
            return "int8"
        if self.weight_format in ("bfloat16", "float16", "float32"):
            return "bf16"
        return None


@dataclass(frozen=True)
class ServerFacts:
    gpus: tuple[GpuInfo, ...]
    budgets: dict[int, str] = field(default_factory=dict)  # gpu index -> the budget in words
    loader: str | None = None  # "DynamicVRAM" | "legacy"; None outside ComfyUI
    model: ModelFacts | None = None
    passes: GraphPasses | None = None

    def device_line(self) -> str:
        if not self.gpus:
            return ("this server: no GPU that ComfyUI computes on (no CUDA/ROCm GPU, or ComfyUI "
                    "started with --cpu)")
        shown = []
        for gpu in self.gpus:
            budget = self.budgets.get(gpu.index)
            shown.append(gpu.describe() + (f", ComfyUI may use {budget}" if budget else ""))
        count = len(self.gpus)
        return f"this server: {count} GPU{'s' if count != 1 else ''}: " + "; ".join(shown)

    def loader_line(self) -> str | None:
        if self.loader is None:
            return None
        if self.loader == "DynamicVRAM":
            return "loader: ComfyUI's DynamicVRAM (comfy-aimdo streams the weights)"
        return "loader: ComfyUI's legacy ModelPatcher"

    def lines(self) -> list[str]:
        out = [self.device_line()]
        out += [line for line in (
            self.loader_line(),
            self.model.describe() if self.model is not None else None,
            self.passes.describe() if self.passes is not None else None) if line]
        return out

    def qualify(self, line: str) -> str:
        """A plan line that counts the official DiT's blocks, said as such when the loaded
        model has another count (a line about 50 blocks is not true of a 4-block model)."""
        if self.model is None or self.model.official_size:
            return line
        return re.sub(rf"\b(?:the )?{geometry.BLOCKS} blocks\b",
                      f"{geometry.BLOCKS} blocks (of the official DiT; this model has "
                      f"{self.model.blocks})", line, count=1)


def graph_passes(prompt: Any, node_id: Any) -> GraphPasses | None:
    """Sampler and upscale nodes downstream of `node_id` in ComfyUI's API prompt (its hidden
    PROMPT input); None when the node ran outside a queued prompt."""
    if not isinstance(prompt, dict) or node_id is None or str(node_id) not in prompt:
        return None
    consumers: dict[str, list[str]] = {}
    for nid, node in prompt.items():
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        for value in inputs.values() if isinstance(inputs, dict) else ():
            if isinstance(value, list) and len(value) == 2 and str(value[0]) in prompt:
                consumers.setdefault(str(value[0]), []).append(str(nid))
    seen, queue = {str(node_id)}, deque([str(node_id)])
    while queue:
        for nxt in consumers.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    kinds = [prompt[n].get("class_type") for n in seen - {str(node_id)}]
    upscale = next((UPSCALE_NODES[k] for k in kinds if k in UPSCALE_NODES), None)
    return GraphPasses(sum(k in SAMPLER_NODES for k in kinds), upscale)


def model_facts(model: Any) -> ModelFacts | None:
    """Block count and weight format of a ModelPatcher's H3 DiT (None when it has no blocks)."""
    from ..comfy_seam.h3 import weight_format

    diffusion = getattr(getattr(model, "model", None), "diffusion_model", None)
    blocks = getattr(diffusion, "blocks", None)
    if not blocks:
        return None
    linear = next((m for m in blocks[0].modules()
                   if getattr(getattr(m, "weight", None), "ndim", 0) == 2), None)
    return ModelFacts(len(blocks), weight_format(linear) if linear is not None else "unknown")


def gather(model: Any = None, prompt: Any = None, node_id: Any = None) -> ServerFacts:
    """This server's facts now (torch's GPUs as ComfyUI uses them, ComfyUI's budget per GPU,
    the loader of `model`, the model itself, the graph's passes)."""
    from ..comfy_seam.memory import dynamic_vram_enabled, is_dynamic, vram_budget
    from .devices import gpu_inventory

    gpus = tuple(gpu_inventory())
    budgets = {}
    for gpu in gpus:
        budget = vram_budget(gpu.index)
        if budget.limits:
            budgets[gpu.index] = budget.describe()
    enabled = dynamic_vram_enabled()
    dynamic = is_dynamic(model) if model is not None and enabled is not None else enabled
    loader = None if dynamic is None else ("DynamicVRAM" if dynamic else "legacy")
    return ServerFacts(gpus=gpus, budgets=budgets, loader=loader,
                       model=model_facts(model) if model is not None else None,
                       passes=graph_passes(prompt, node_id))
