"""Measure the rates the planner's time model uses on one GPU and compare them with its data.

Rows (each against `planner/profiles.json` for this GPU's exact model name):
- bf16_gemm: a DiT block's four linears (qkv 5376->21504, out 7168->5376, fc1 5376->28672,
  fc2 14336->5376) in bf16 at S = 35,305 rows (PASS2 1312x736, 124 frames);
- int8_gemm: the same four through comfy-kitchen's `int8_linear` with ConvRot (what ComfyUI runs
  for the official INT8 checkpoint), or, without comfy-kitchen, torch._int_mm on row-quantized
  activations (labelled);
- attention: 56 heads x 128 on H3's strided views of a [S, 21504] qkv buffer at S = 35,305 and
  68,706: SDPA under ComfyUI's backend priority (flash first: "sdpa"), under PyTorch's default
  priority ("cudnn" on Hopper), comfy-kitchen INT8 ("ck") and sageattention ("sage") where
  importable;
- h2d_pinned / h2d_pageable: one INT8 DiT block (385 MB) host -> GPU;
- memory_copy: a 2 GiB device copy (read + write), against the datasheet bandwidth.
Rates count FLOPs the planner's way (2*M*N*K per GEMM, 4*S^2*128*56 per attention call).

Usage (device machine, ~1-2 min): python dev/bench/bench_time_model.py --out $OUT/time_model.json
CPU smoke test (tiny shapes, no comparison): python dev/bench/bench_time_model.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from h3_multigpu.common import geometry
from h3_multigpu.planner.components import OFFICIAL
from h3_multigpu.planner.hardware import spec_for_name

LINEARS = ((geometry.HIDDEN, 3 * geometry.INNER), (geometry.INNER, geometry.HIDDEN),
           (geometry.HIDDEN, 2 * geometry.FFN), (geometry.FFN, geometry.HIDDEN))  # (K, N)
TINY_LINEARS = ((64, 192), (64, 64), (64, 256), (128, 64))  # --dry-run
GEMM_ROWS = 35_305
ATTENTION_LENGTHS = (35_305, 68_706)
TOLERANCE = 0.10


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall time of `reps` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # elapsed_time is readable only once both events completed
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_flops(rows: int, linears) -> float:
    return sum(2.0 * rows * k * n for k, n in linears)


def bench_bf16_gemm(device: torch.device, rows: int, reps: int, linears) -> dict:
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for k, n in linears]
    inputs = [torch.randn(rows, k, device=device, dtype=torch.bfloat16) for k, _ in linears]

    def run():
        for x, w in zip(inputs, weights, strict=True):
            F.linear(x, w)

    ms = timed_ms(run, device, reps)
    return {"row": "bf16_gemm", "S": rows, "ms": ms,
            "measured": gemm_flops(rows, linears) / ms / 1e9,
            "unit": "TFLOPS", "what": "four bf16 linears"}


def bench_int8_gemm(device: torch.device, rows: int, reps: int, linears) -> dict:
    weights = [torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
               for k, n in linears]
    scale = torch.tensor(0.01, device=device, dtype=torch.float32)
    inputs = [torch.randn(rows, k, device=device, dtype=torch.bfloat16) for k, _ in linears]
    try:
        import comfy_kitchen as ck

        def run():
            for x, w in zip(inputs, weights, strict=True):
                ck.int8_linear(x, w, scale, None, torch.bfloat16, convrot=True,
                               convrot_groupsize=256)

        what = f"comfy-kitchen {getattr(ck, '__version__', '?')} int8_linear, ConvRot 256"
        run()
    except (ImportError, RuntimeError, TypeError, ValueError) as exc:
        if device.type != "cuda":
            return {"row": "int8_gemm", "skipped": f"no INT8 GEMM here ({exc!r})"}

        def run():
            for x, w in zip(inputs, weights, strict=True):
                amax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
                q = (x * (127.0 / amax)).round().to(torch.int8)
                (torch._int_mm(q, w.t()).float() * amax).to(torch.bfloat16)

        what = f"torch._int_mm, row-quantized (comfy-kitchen unavailable: {exc!r})"
    ms = timed_ms(run, device, reps)
    return {"row": "int8_gemm", "S": rows, "ms": ms,
            "measured": gemm_flops(rows, linears) / ms / 1e9,
            "unit": "TOPS", "what": what}


def _comfy_priority():
    """ComfyUI's SDPA backend priority (comfy/ops.py on CUDA: flash, cuDNN, efficient, math)."""
    import inspect

    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel(order[:1])  # an older torch: flash only (ComfyUI's first choice)


def attention_functions() -> dict[str, tuple[Callable | None, str]]:
    from h3_multigpu.kernels import registry

    def comfy_sdpa(q, k, v):
        with _comfy_priority():
            return F.scaled_dot_product_attention(q, k, v)

    def torch_default(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    out: dict[str, tuple[Callable | None, str]] = {
        "sdpa": (comfy_sdpa, "SDPA under ComfyUI's priority (flash first)"),
        "cudnn": (torch_default, "SDPA under PyTorch's default priority")}
    for kernel, name in (("ck", "ck_int8"), ("sage", "sageattention"), ("flash", "flash")):
        status = {s.name: s for s in registry.list_backends()}.get(name)
        if status is None or not status.available:
            out[kernel] = (None, status.reason if status else f"{name} not registered")
        else:
            backend = registry.get_backend(name)
            out[kernel] = (lambda q, k, v, b=backend: b.fn(q, k, v), status.reason)
    return out


def bench_attention(device: torch.device, lengths: tuple[int, ...], reps: int) -> list[dict]:
    heads, dim = geometry.HEADS, geometry.HEAD_DIM
    rows = []
    functions = attention_functions()
    for s in lengths:
        qkv = torch.randn(s, 3 * heads * dim, device=device, dtype=torch.bfloat16)
        # H3's call: q, k, v as strided [1, 56, S, 128] views of the qkv buffer
        views = qkv.view(1, s, 3, heads, dim)
        q, k, v = (views[:, :, 0].transpose(1, 2), views[:, :, 1].transpose(1, 2),
                   views[:, :, 2].transpose(1, 2))
        flops = geometry.attention_flops(s)
        for kernel, (fn, what) in functions.items():
            if fn is None:
                rows.append({"row": f"attention_{kernel}", "S": s, "skipped": what})
                continue
            try:
                ms = timed_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), device, reps)
            except (RuntimeError, ValueError) as exc:
                rows.append({"row": f"attention_{kernel}", "S": s, "skipped": repr(exc)[:200]})
                continue
            rows.append({"row": f"attention_{kernel}", "S": s, "ms": ms,
                         "measured": flops / ms / 1e9, "unit": "TFLOPS", "what": what})
        del qkv, views, q, k, v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_copies(device: torch.device, block_bytes: int, reps: int) -> list[dict]:
    if device.type != "cuda":
        return []
    dst = torch.empty(block_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(block_bytes, dtype=torch.uint8)
    rows = []
    for name, src in (("h2d_pinned", pinned), ("h2d_pageable", pageable)):
        ms = timed_ms(lambda src=src: dst.copy_(src, non_blocking=True), device, reps)
        rows.append({"row": name, "ms": ms, "measured": block_bytes / ms / 1e6, "unit": "GB/s",
                     "what": f"one INT8 DiT block ({block_bytes / 1e6:.0f} MB)"})
    big = 2 << 30
    a = torch.empty(big, dtype=torch.uint8, device=device)
    b = torch.empty(big, dtype=torch.uint8, device=device)
    ms = timed_ms(lambda: a.copy_(b), device, reps)
    rows.append({"row": "memory_copy", "ms": ms, "measured": 2 * big / ms / 1e6, "unit": "GB/s",
                 "what": "2 GiB device copy, read + write"})
    return rows


def predicted(row: dict, device_name: str) -> float | None:
    """The planner's number for this row (profiles.json, exact model name), None if none."""
    from h3_multigpu.planner import PROFILES

    spec = spec_for_name(device_name)
    if spec is None:
        return None
    name = row["row"]
    if name.startswith("attention_"):
        return spec.attention_rates.get(name.removeprefix("attention_"))
    links = [p.link for p in PROFILES.values() if p.gpus[0].name == spec.name]
    return {"bf16_gemm": spec.matmul_tflops, "int8_gemm": spec.int8_matmul_tops,
            "memory_copy": spec.memory_bandwidth_gbs,
            "h2d_pinned": links[0].host_pinned_gbs if links else None,
            "h2d_pageable": links[0].host_pageable_gbs if links else None}.get(name)


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else args.device)
    rows_gemm = 256 if args.dry_run else GEMM_ROWS
    lengths = (128,) if args.dry_run else ATTENTION_LENGTHS
    reps = 2 if args.dry_run else args.reps
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    linears = TINY_LINEARS if args.dry_run else LINEARS
    rows = [bench_bf16_gemm(device, rows_gemm, reps, linears),
            bench_int8_gemm(device, rows_gemm, reps, linears)]
    rows += bench_attention(device, lengths, reps)
    rows += bench_copies(device, OFFICIAL.dit_block_bytes, reps)
    for row in rows:
        if "measured" not in row:
            continue
        want = None if args.dry_run else predicted(row, name)
        row["predicted"] = want
        if want:
            row["ratio"] = row["measured"] / want
            row["within_10pct"] = abs(row["ratio"] - 1) <= TOLERANCE
    return {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
            "command": "python dev/bench/bench_time_model.py" + (" --dry-run" if args.dry_run
                                                               else f" --out {args.out}"),
            "wall_s": round(time.perf_counter() - start, 1), "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['device']} (torch {result['torch']}), {result['wall_s']} s",
             f"{'row':<18} {'S':>7} {'measured':>10} {'planner':>9} {'ratio':>6}  within 10%"]
    for r in result["rows"]:
        s = f"{r['S']:,}" if "S" in r else "-"
        if "measured" not in r:
            lines.append(f"{r['row']:<18} {s:>7} skipped: {r['skipped'][:60]}")
            continue
        want = f"{r['predicted']:.1f}" if r.get("predicted") else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        ok = ("yes" if r["within_10pct"] else "NO") if "within_10pct" in r else "-"
        lines.append(f"{r['row']:<18} {s:>7} {r['measured']:>10.1f} {want:>9} {ratio:>6}  {ok} "
                     f"({r['unit']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
