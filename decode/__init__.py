"""Video VAE decode shared between GPUs, bit-identical to ComfyUI's one-GPU decode.

`windows` (pure): the decoder's temporal windows and how they are cut between devices.
`sizing` (pure): measured memory and time of a window, for the planner.
`release`: what the split needs of the VAE class, detected per release (0.33.0, newest files).
`replica`: a decoding copy of the loaded VAE on another device (DynamicVRAM off), or ComfyUI's
  own multi-GPU clone of it (`comfy_clone`); every ComfyUI call goes through `comfy_seam`.
`executor`: the threads that run the VAE's own window loop per device into one output buffer.
`apply`: the ComfyUI seam (`apply_multi_gpu_decode`, an object patch on `decode_temporal`).
"""

from .windows import WindowLayout, assign_windows, frames_to_latents, parse_weights

__all__ = ["WindowLayout", "assign_windows", "frames_to_latents", "parse_weights",
           "MultiGPUDecodeConfig", "apply_multi_gpu_decode"]


def __getattr__(name: str):
    # torch-side names load lazily so the planner imports `decode.sizing` without torch
    if name in ("MultiGPUDecodeConfig", "apply_multi_gpu_decode", "MultiGPUDecode", "find_patch",
                "HelperCopy", "Helper", "install"):
        from . import apply

        return getattr(apply, name)
    raise AttributeError(name)
