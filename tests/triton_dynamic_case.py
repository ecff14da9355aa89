"""Run in a process of its own by tests/test_triton_sage.py: the Triton kernel under ComfyUI's
DynamicVRAM (comfy-aimdo) with its refusal lifted, over H3's shapes and both P*V types, with
ComfyUI's soft_empty_cache after each shape (where a DynamicVRAM GPU session once crashed).
Prints TRITON_UNDER_AIMDO_DONE when every call returned; a crash ends the process."""

import faulthandler
import sys
from pathlib import Path

faulthandler.enable()
sys.path.insert(0, str(Path(__file__).parent))

from comfyui_h3 import enable_dynamic_vram  # noqa: E402

comfy = enable_dynamic_vram()

import torch  # noqa: E402

from h3_multigpu.kernels import triton_sage as ts  # noqa: E402

assert ts.dynamic_vram_refusal() is not None, "DynamicVRAM is not on in this process"
ts.dynamic_vram_refusal = lambda: None  # the experiment: does the kernel itself crash here?
calls = 0
for _ in range(3):
    for s in (1, 63, 64, 65, 4097, 15399, 40000):
        buf = torch.randn(s, 3 * 8 * 128, device="cuda", dtype=torch.bfloat16)
        q, k, v = (buf.view(s, 3, 8, 128)[:, i, :4].transpose(0, 1).unsqueeze(0)
                   for i in range(3))
        for pv in ("fp16", "fp8") if ts.fp8_supported(buf.device) else ("fp16",):
            ts.triton_sage_attention(q, k, v, pv_dtype=pv)
            torch.cuda.synchronize()
            calls += 1
        del buf, q, k, v
        comfy.model_management.soft_empty_cache()
print(f"TRITON_UNDER_AIMDO_DONE {calls} calls", flush=True)
