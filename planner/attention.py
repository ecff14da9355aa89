"""The attention kernel the plan is timed with: the one ComfyUI runs, or the one the user names.

Inside ComfyUI the nodes pass what ComfyUI would run (its `optimized_attention`, chosen by its
flags, or the checkpoint's preferred attention); on the command line `--attention` names it, and
"auto" is ComfyUI's default (PyTorch SDPA) unless the DiT file's header prefers another.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import QUANTIZED_ATTENTION, HardwareProfile

# what selects each kernel in ComfyUI (comfy/cli_args.py, 0.33.0 and the newest files)
COMFY_FLAGS = {
    "sdpa": "ComfyUI's default (PyTorch SDPA, flash backend first)",
    "flash": "--use-flash-attention",
    "sage": "--use-sage-attention",
    "ck": "--use-ck-attention",
    "cudnn": "PyTorch's default SDPA priority (cuDNN on Hopper; the pack's lab benchmarks)",
}
KERNEL_WORDS = {
    "sdpa": "PyTorch SDPA", "flash": "FlashAttention (flash-attn)",
    "sage": "SageAttention (INT8 QK, approximate)", "ck": "comfy-kitchen INT8 (approximate)",
    "cudnn": "PyTorch SDPA, cuDNN",
}


@dataclass(frozen=True, kw_only=True)
class AttentionChoice:
    """Stage input: the attention kernel every attention call of the DiT runs."""

    kernel: str  # "sdpa" | "flash" | "sage" | "ck" (| "cudnn" for lab comparisons)
    requested: str
    reason: str

    @property
    def quantized(self) -> bool:
        return self.kernel in QUANTIZED_ATTENTION

    @property
    def flag(self) -> str:
        return COMFY_FLAGS[self.kernel]

    def describe(self) -> str:
        return f"{self.kernel} ({KERNEL_WORDS[self.kernel]}) -- {self.reason}"


def resolve_attention(*, requested: str, checkpoint_kernel: str | None = None
                      ) -> AttentionChoice:
    """The kernel for `requested` ("auto" or a kernel name); `checkpoint_kernel` is what the
    DiT file's attention config prefers (None when it states none)."""
    if requested != "auto":
        return AttentionChoice(kernel=requested, requested=requested,
                               reason=f"as requested ({COMFY_FLAGS[requested]})")
    if checkpoint_kernel is not None:
        return AttentionChoice(kernel=checkpoint_kernel, requested="auto", reason=(
            f"auto: the DiT file's attention config prefers {checkpoint_kernel} (ComfyUI "
            "runs it where the kernel is available)"))
    return AttentionChoice(kernel="sdpa", requested="auto", reason=(
        "auto: ComfyUI's default without an attention flag; name yours with --attention "
        "(sage: --use-sage-attention, flash, ck: --use-ck-attention)"))


def missing_kernel_notes(choice: AttentionChoice, profile: HardwareProfile,
                         devices: list[int]) -> list[str]:
    """One note per GPU that has no rate for the chosen kernel (timed at SDPA's instead)."""
    notes = []
    for index in devices:
        gpu = profile.gpus[index]
        if choice.kernel in gpu.attention_rates:
            continue
        what = ("has no INT8 attention kernel" if choice.quantized else
                f"has no {choice.kernel} kernel")
        notes.append(f"attention {choice.kernel}: gpu:{index} ({gpu.name}) {what}; its "
                     f"attention is timed at the {gpu.compute_dtype} SDPA rate")
    return notes
