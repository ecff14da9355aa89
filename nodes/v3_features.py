"""Thin per-feature nodes: MODEL + options -> patched MODEL + the feature's status line.

Each calls the library's `apply_*` (which clones the model and records its status in
`transformer_options["h3_multigpu"]`); the option strings are checked here first so a typo
is a message on the node, not a failed run.
"""

from __future__ import annotations

from comfy_api.latest import io

from .comfy_types import CATEGORY, preview_text
from .features import FeatureUnavailable, apply_from_strings, check_options
from .status import feature_lines, hooks_line


def backend_names() -> list[str]:
    """Attention backends `kernels` can run here (sdpa, the reference, always first)."""
    try:
        from ..kernels import list_backends
    except ImportError:
        return ["sdpa"]
    names = [row.name for row in list_backends() if row.available]
    return sorted(names, key=lambda n: (n != "sdpa", n)) or ["sdpa"]


def _result(model, feature: str) -> io.NodeOutput:
    line = feature_lines(model).get(
        feature, "applied (the library recorded no status line)")
    status = f"{feature}: {line}"
    hooks = hooks_line(model)
    if hooks is not None:
        status += f"\n{hooks}"
    return io.NodeOutput(model, status, ui=preview_text(status))


def _guard(model, feature: str, **options) -> io.NodeOutput:
    try:
        return _result(apply_from_strings(model, feature, **options), feature)
    except FeatureUnavailable as exc:
        status = f"{feature}: NOT ACTIVE: {exc}"
        return io.NodeOutput(model, status, ui=preview_text(status))


def _outputs() -> list:
    return [io.Model.Output(display_name="model"), io.String.Output(display_name="status")]


def _validate(feature: str, required: dict, optional: dict) -> str | bool:
    """The library parses the strings; a linked (None) required input waits for run time."""
    if any(v is None for v in required.values()):
        return True
    options = {**required, **{k: v for k, v in optional.items() if v is not None}}
    return check_options(feature, **options) or True


class H3MultiGPUDualSage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUDualSage", display_name="H3 Dual-Sage", category=CATEGORY,
            description="Shards each attention call's 56 heads between the DiT's GPU and "
                        "helper GPUs, running on every GPU the attention ComfyUI would run; "
                        "exact (same numbers as one GPU) where that function treats heads "
                        "independently.",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("helpers", default="auto",
                                tooltip="Helper GPUs, e.g. 'gpu:0' or 'gpu:0,gpu:2'; auto = all "
                                        "GPUs but the DiT's."),
                io.String.Input("split", default="auto",
                                tooltip="Heads per GPU, DiT's GPU first, e.g. '28:28'; must sum "
                                        "to 56. auto = by measured throughput."),
            ],
            outputs=_outputs(),
        )

    @classmethod
    def validate_inputs(cls, helpers=None, split=None, min_tokens=None):
        return _validate("dual_sage", {"helpers": helpers, "split": split},
                         {"min_tokens": min_tokens})

    @classmethod
    def execute(cls, model, helpers, split, backend="comfyui", min_tokens="auto",
                exact_only=True):
        return _guard(model, "dual_sage", helpers=helpers, split=split, backend=backend,
                      min_tokens=min_tokens, exact_only=exact_only)


class H3MultiGPUDualSageAdvanced(H3MultiGPUDualSage):
    @classmethod
    def define_schema(cls):
        schema = super().define_schema()
        schema.node_id = "H3MultiGPUDualSageAdvanced"
        schema.display_name = "H3 Dual-Sage (Advanced)"
        schema.inputs = [
            *schema.inputs,
            io.Combo.Input("backend", options=["comfyui", *backend_names()], default="comfyui",
                           tooltip="Attention on every GPU. comfyui = what ComfyUI would run "
                                   "(the checkpoint's preferred attention, else its default): "
                                   "exact. Others: a kernel of this pack; quantizing kernels "
                                   "are faster and approximate."),
            io.String.Input("min_tokens", default="auto",
                            tooltip="Shorter sequences stay on one GPU (the transfer would cost "
                                    "more than it saves). auto = from the link's speed."),
            io.Boolean.Input("exact_only", default=True,
                             tooltip="Split only calls whose head subsets give the same bits as "
                                     "the whole call on this GPU (measured range); off splits "
                                     "every call above min_tokens."),
        ]
        return schema


class H3MultiGPUChunking(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUChunking", display_name="H3 Activation Chunking",
            category=CATEGORY,
            description="Runs the FFN (and optionally QKV and attention heads) in sequence "
                        "chunks to cap the activation peak. Exact with chunks of 4096+ rows and "
                        "4+ heads per call ('auto' stays there); smaller chunks may differ at "
                        "bf16 rounding, and the status says so.",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("ffn_chunk", default="auto",
                                tooltip="Tokens per FFN chunk; auto = from free memory, 0 = off. "
                                        "4096 or more is exact."),
            ],
            outputs=_outputs(),
        )

    @classmethod
    def validate_inputs(cls, ffn_chunk=None, qkv_chunk=None, head_group=None):
        return _validate("chunking", {"ffn_chunk": ffn_chunk},
                         {"qkv_chunk": qkv_chunk, "head_group": head_group})

    @classmethod
    def execute(cls, model, ffn_chunk, qkv_chunk="auto", head_group="auto"):
        return _guard(model, "chunking", ffn_chunk=ffn_chunk, qkv_chunk=qkv_chunk,
                      head_group=head_group)


class H3MultiGPUChunkingAdvanced(H3MultiGPUChunking):
    @classmethod
    def define_schema(cls):
        schema = super().define_schema()
        schema.node_id = "H3MultiGPUChunkingAdvanced"
        schema.display_name = "H3 Activation Chunking (Advanced)"
        schema.inputs = [
            *schema.inputs,
            io.String.Input("qkv_chunk", default="auto",
                            tooltip="Tokens per QKV projection chunk (LoRA included); 0 = off. "
                                    "4096 or more is exact."),
            io.String.Input("head_group", default="auto",
                            tooltip="Heads attended at once; 0 = all 56. 4 or more is exact "
                                    "(enlarged on short sequences)."),
        ]
        return schema


class H3MultiGPUPrefetch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUPrefetch", display_name="H3 Block Prefetch", category=CATEGORY,
            description="Keeps some DiT blocks resident and streams the rest from pinned host "
                        "memory ahead of use, to fit PASS2 on smaller GPUs (ComfyUI's legacy "
                        "loader; under DynamicVRAM ComfyUI streams the weights itself and this "
                        "node stands aside, saying so).",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("resident_blocks", default="auto",
                                tooltip="DiT blocks (of 50) that stay on the GPU; auto = as many "
                                        "as fit, decided before the model loads."),
            ],
            outputs=_outputs(),
        )

    @classmethod
    def validate_inputs(cls, resident_blocks=None, pinned_budget=None):
        return _validate("prefetch", {"resident_blocks": resident_blocks},
                         {"pinned_budget": pinned_budget})

    @classmethod
    def execute(cls, model, resident_blocks, lookahead=2, pinned_budget="auto"):
        return _guard(model, "prefetch", resident_blocks=resident_blocks, lookahead=lookahead,
                      pinned_budget=pinned_budget)


class H3MultiGPUPrefetchAdvanced(H3MultiGPUPrefetch):
    @classmethod
    def define_schema(cls):
        schema = super().define_schema()
        schema.node_id = "H3MultiGPUPrefetchAdvanced"
        schema.display_name = "H3 Block Prefetch (Advanced)"
        schema.inputs = [
            *schema.inputs,
            io.Int.Input("lookahead", default=2, min=1, max=8,
                         tooltip="Blocks copied ahead of the one running."),
            io.String.Input("pinned_budget", default="auto",
                            tooltip="Pinned host memory the streamer may take, e.g. '24GiB'; "
                                    "auto = what is left of ComfyUI's pin budget "
                                    "(MAX_PINNED_MEMORY)."),
        ]
        return schema


class H3MultiGPUSageAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPUSageAttention", display_name="H3 Sage Attention",
            category=CATEGORY,
            description="Single-GPU: runs the model's attention with a kernel from this pack "
                        "(chained under an override already installed, e.g. Dual-Sage).",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("backend", options=backend_names(),
                               tooltip="sdpa = PyTorch reference (exact); others as listed by "
                                       "the kernel registry on this machine."),
            ],
            outputs=_outputs(),
        )

    @classmethod
    def execute(cls, model, backend):
        from .attention_override import apply_backend_override

        return _result(apply_backend_override(model, backend), "attention")


NODES = [H3MultiGPUDualSage, H3MultiGPUDualSageAdvanced, H3MultiGPUChunking,
         H3MultiGPUChunkingAdvanced, H3MultiGPUPrefetch, H3MultiGPUPrefetchAdvanced,
         H3MultiGPUSageAttention]
