"""ComfyUI's cancel, seen from the pack's own loops and helper threads.

ComfyUI cancels a prompt by setting one flag (`model_management.interrupt_current_processing`,
0.33.0 and newest); whoever calls `throw_exception_if_processing_interrupted` next CLEARS it and
raises `InterruptProcessingException`, which `execution.py` reports as "interrupted". Every
`comfy.ops` layer checks it (`run_every_op`), so the DiT's own block loop sees a cancel within
one linear. The pack checks it itself where ComfyUI would not: between the blocks of the
latent upscaler (plain torch layers), and before each streamed DiT block is copied in.

The flag is consumed by the first checker, whatever thread it runs on: a helper thread whose
comfy op saw it must hand the exception back to the thread ComfyUI waits on (`is_interrupt`),
never treat it as a helper failure, or the cancel is lost.
"""

from __future__ import annotations

from ..comfy_seam.runtime import loaded_model_management

INTERRUPT_EXCEPTION = "InterruptProcessingException"  # comfy.model_management's class name


def check_interrupt() -> None:
    """Raise ComfyUI's InterruptProcessingException when a cancel is pending (clearing it, as
    ComfyUI's own checks do); nothing outside ComfyUI."""
    mm = loaded_model_management()
    check = getattr(mm, "throw_exception_if_processing_interrupted", None)
    if check is not None:
        check()


def is_interrupt(exc: BaseException) -> bool:
    """ComfyUI's cancel (its InterruptProcessingException, matched by name so this module never
    imports ComfyUI), or a KeyboardInterrupt."""
    return isinstance(exc, KeyboardInterrupt) or any(
        cls.__name__ == INTERRUPT_EXCEPTION for cls in type(exc).__mro__)
