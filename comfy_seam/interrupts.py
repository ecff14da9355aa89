"""ComfyUI's cancel, as the pack's loops, helper threads and the split decode see it.

ComfyUI cancels a prompt by setting one flag (`model_management.interrupt_current_processing`,
0.33.0 and newest); whoever calls `throw_exception_if_processing_interrupted` next CLEARS it and
raises `InterruptProcessingException` (a BaseException), which `execution.py` reports as
"interrupted". Every `comfy.ops` layer checks it (`run_every_op`), so the DiT's own block loop
sees a cancel within one linear. The pack checks it itself where ComfyUI would not: between the
blocks of the latent upscaler (plain torch layers), before each streamed DiT block is copied
in, at the sequence mode's rendezvous and between the split decode's windows.

The flag is consumed by the first checker, whatever thread it runs on: a helper thread whose
comfy op saw it must hand the exception back to the thread ComfyUI waits on (`is_interrupt`),
never treat it as a helper failure, or the cancel is lost.

ComfyUI is never imported here (`runtime.model_management()`, loaded only): outside ComfyUI
(the CLI, the twin tests) nobody can set the flag, and every check is a no-op.
"""

from __future__ import annotations

from . import runtime

# comfy.model_management's class, matched by name so the check needs no ComfyUI import (a
# test's stand-in of the same name is one too); `internals.INTERNALS` resolves it per release
INTERRUPT_EXCEPTION = "InterruptProcessingException"


def processing_interrupted() -> bool:
    """Whether a cancel is pending (`model_management.processing_interrupted()`; the flag is
    left set)."""
    check = getattr(runtime.model_management(), "processing_interrupted", None)
    return bool(check()) if check is not None else False


def raise_if_interrupted() -> None:
    """Raise ComfyUI's InterruptProcessingException when a cancel is pending, clearing it as
    ComfyUI's own checks do (`throw_exception_if_processing_interrupted`); nothing outside
    ComfyUI."""
    throw = getattr(runtime.model_management(), "throw_exception_if_processing_interrupted",
                    None)
    if throw is not None:
        throw()


def is_interrupt(exc: BaseException) -> bool:
    """ComfyUI's cancel (its InterruptProcessingException), or a KeyboardInterrupt."""
    return isinstance(exc, KeyboardInterrupt) or any(
        cls.__name__ == INTERRUPT_EXCEPTION for cls in type(exc).__mro__)
