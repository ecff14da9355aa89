"""Are row slices of H3's quantized GEMMs bit-identical to the whole call? One GPU, ~1 min.

    python dev/bench/sweep_int8_chunk_exactness.py --out $OUT/int8_chunk_exactness.json

`chunking/exact_rows.py` lets INT8 ConvRot linears (the official DiT's format) run row chunks
and row shares of any size on NVIDIA GPUs, because comfy-kitchen's `int8_linear` quantizes the
activations per row and accumulates in int32. This sweep checks that claim with the kernel
ComfyUI's ops call (`comfy_kitchen.int8_linear(x, qdata, scale, convrot=True,
convrot_groupsize=256)`, and the fused SwiGLU fc2 `input_act="swiglu"` that H3's MLP runs
through `comfy.ops.linear_input_act`) on H3's four shapes, bf16 activations: for every slice
size m (1 row up) and offset (first rows, last rows) the m-row call against the same rows of
one whole call of S rows. `--fp8` adds FP8 (E4M3 weight, static per-tensor input scale,
`torch._scaled_mm` with fp32 accumulation, as ComfyUI's TensorCoreFP8Layout runs it): the floors
it prints are what a later `exact_rows` FP8 rule would store (FP8 is kept whole until then).

The summary says, per shape, the fewest rows from which every slice was exact ("1": the
any-rows rule holds) and the largest |diff| seen below it. `--dry-run` runs on the CPU with
comfy-kitchen's eager kernel and small shapes (checks the script; on the CPU fp32 activations
differ for slices of up to 11 rows with 2 threads, bf16 ones do not).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

HIDDEN, HEADS, HEAD_DIM, FFN = 5376, 56, 128, 14336
SHAPES = {  # name: (K, N, fused input activation)
    "qkv_proj": (HIDDEN, 3 * HEADS * HEAD_DIM, None),
    "out_proj": (HEADS * HEAD_DIM, HIDDEN, None),
    "fc1": (HIDDEN, 2 * FFN, None),
    "fc2+swiglu": (2 * FFN, HIDDEN, "swiglu"),  # K: fc1's output, halved by SwiGLU
}
ROWS = (1, 2, 3, 5, 7, 11, 13, 16, 31, 64, 127, 256, 777, 1000, 2048, 2300, 4096, 5000, 8192)
REFS = (3320, 16640)
GROUP = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--refs", type=int, nargs="+", default=list(REFS))
    p.add_argument("--fp8", action="store_true", help="also FP8 (static input scale)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="activation dtype (ComfyUI computes bf16 on a GPU)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, small shapes and sizes: checks the script")
    p.add_argument("--out", type=Path,
                   default=Path(os.environ.get("OUT", ".")) / "int8_chunk_exactness.json")
    return p.parse_args(argv)


def int8_weight(n: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 qdata [N, K] and an fp32 per-output-channel scale [N, 1] (a quantized Gaussian)."""
    w = torch.randn((n, k), device=device, generator=gen) / k ** 0.5
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.float()


def int8_call(x, qdata, scale, act):
    import comfy_kitchen as ck

    return ck.int8_linear(x, qdata, scale, None, x.dtype, convrot=True,
                          convrot_groupsize=GROUP, input_act=act)


def fp8_parts(n: int, k: int, x_all: torch.Tensor, device, gen):
    """E4M3 weight and scales; the input scale fixed from the whole input (static)."""
    w = torch.randn((n, k), device=device, generator=gen) / k ** 0.5
    w_scale = (w.abs().max() / 448.0).float()
    w8 = (w / w_scale).to(torch.float8_e4m3fn)
    x_scale = (x_all.abs().max().float() / 448.0)
    return w8, w_scale, x_scale


def fp8_call(x, w8, w_scale, x_scale):
    x8 = (x.float() / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)


def sweep(name: str, call, k: int, rows: list[int], refs: list[int], device, dtype, gen
          ) -> dict:
    s_max = max(refs)
    x = torch.randn((s_max, k), device=device, dtype=torch.float32, generator=gen).to(dtype)
    wholes = {s: call(x[:s]) for s in refs}
    cases, worst_bad = [], 0
    for m in rows:
        for s in refs:
            if m > s:
                continue
            for start in sorted({0, s - m}):
                part = call(x[start:start + m])
                diff = (part.float() - wholes[s][start:start + m].float()).abs().max().item()
                exact = diff == 0.0 and torch.equal(part, wholes[s][start:start + m])
                cases.append({"rows": m, "whole": s, "start": start, "exact": exact,
                              "max_abs_diff": diff})
                if not exact:
                    worst_bad = max(worst_bad, m)
    exact_from = None
    ok = sorted({c["rows"] for c in cases if c["rows"] > worst_bad})
    if ok:
        exact_from = ok[0]
    print(f"{name:24s} exact from {exact_from} rows"
          + (f" (slices of <= {worst_bad} rows differ, max |diff| "
             f"{max(c['max_abs_diff'] for c in cases if not c['exact']):.3g})" if worst_bad
             else " (every slice size)"), flush=True)
    return {"min_exact_rows": exact_from, "largest_inexact_rows": worst_bad or None,
            "cases": cases}


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    dtype = getattr(torch, args.dtype)
    shapes, rows, refs = SHAPES, args.rows, args.refs
    if args.dry_run:
        shapes = {"qkv_proj": (512, 1536, None), "fc2+swiglu": (1024, 256, "swiglu")}
        rows, refs = [1, 3, 11, 16, 40], [44, 100]
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.time()
    report: dict = {"meta": {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "args": {"rows": rows, "refs": refs}},
        "int8_convrot": {}, "fp8": {}}
    try:
        import comfy_kitchen

        report["meta"]["comfy_kitchen"] = getattr(comfy_kitchen, "__version__", "?")
    except ImportError as exc:
        raise SystemExit(f"comfy-kitchen is needed (pip install comfy-kitchen): {exc}") from exc
    with torch.inference_mode():
        for name, (k, n, act) in shapes.items():
            n_weight = n
            k_weight = k // 2 if act == "swiglu" else k
            qdata, scale = int8_weight(n_weight, k_weight, device, gen)
            report["int8_convrot"][name] = sweep(
                f"int8 convrot {name}", lambda x, q=qdata, s=scale, a=act: int8_call(x, q, s, a),
                k, rows, refs, device, dtype, gen)
            if args.fp8 and act is None and device.type == "cuda":
                probe = torch.randn((max(refs), k), device=device, generator=gen).to(dtype)
                w8, w_scale, x_scale = fp8_parts(n, k, probe, device, gen)
                report["fp8"][name] = sweep(
                    f"fp8 {name}", lambda x, w=w8, ws=w_scale, xs=x_scale: fp8_call(x, w, ws, xs),
                    k, rows, refs, device, dtype, gen)
    report["meta"]["seconds"] = round(time.time() - started, 1)
    holds = all(entry["min_exact_rows"] == min(rows)
                for entry in report["int8_convrot"].values())
    report["int8_any_rows_rule_holds"] = holds
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"INT8 ConvRot any-rows rule (chunking/exact_rows.py) {'HOLDS' if holds else 'FAILS'} "
          f"on {report['meta']['device']}, {args.dtype} activations; JSON: {args.out}")


if __name__ == "__main__":
    main()
