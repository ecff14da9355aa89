"""When is a head subset of an SDPA call bit-identical to the whole call? One GPU, ~30 s.

    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_split_exactness.py \
        --out $OUT/split_exactness.json [--write-range common/exact_range.json]

For each SDPA backend ComfyUI's priority can pick (flash, cudnn, efficient, math, each forced),
and for ComfyUI's own `attention_pytorch` (its priority; the pack's copy of that priority when
ComfyUI is not importable), over H3's bf16 `[1, 56, S, 128]` strided qkv views: run all 56
heads once, then subsets of h heads as Dual-Sage runs them (the root's first h heads as strided
views, a helper chunk of the last h heads as a contiguous copy), and compare bit for bit.
The JSON lists every case and, per backend, the `min_heads_x_rows_per_sm` threshold that
`common/exact_range.json` stores (`--write-range` writes that file). A short table is last.
`--dry-run` runs the code path on the CPU with tiny sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from h3_multigpu.common.exactness import derive_per_sm, sdpa_backend

HEADS, HEAD_DIM = 56, 128
SIZES = (3_320, 4_096, 8_192, 15_399, 35_305)
SUBSETS = (28, 14, 8, 7, 5, 4, 2, 1)
MATH_MAX_S = 8_192  # the math backend materialises S x S scores per head


def backends_under_test(device: torch.device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    out = {name: (lambda b=backend: sdpa_kernel([b])) for name, backend in forced.items()}
    if device.type == "cpu":
        out = {"math": out["math"]}
    return out


def comfyui_attention():
    """(fn(q, k, v) -> [1, H, S, D], what) running ComfyUI's attention_pytorch."""
    root = os.environ.get("COMFYUI_PATH")
    try:
        if not root:
            raise ImportError("COMFYUI_PATH unset")
        sys.path.insert(0, root)
        import comfy.cli_args

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        from comfy.ldm.modules import attention as comfy_attention
    except Exception as exc:  # fall back to the same priority list, said in the report
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

        def priority(q, k, v):
            with sdpa_kernel(order, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v)

        return priority, f"SDPA with ComfyUI's priority (ComfyUI not importable: {exc})"

    def run(q, k, v):
        return comfy_attention.attention_pytorch(q, k, v, q.shape[1], skip_reshape=True,
                                                 skip_output_reshape=True)

    return run, "ComfyUI attention_pytorch"


def strided_qkv(seq_len, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * HEADS * HEAD_DIM, generator=gen, device=device, dtype=dtype)
    return tuple(t.view(seq_len, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(HEADS * HEAD_DIM, dim=-1))


def sweep_one(name, run, views, sms, seq_len) -> list[dict]:
    q, k, v = views
    full = run(q, k, v)
    cases = []
    for h in SUBSETS:
        root_out = run(q[:, :h], k[:, :h], v[:, :h])  # the root's heads: strided views
        slot = torch.stack([t[0, HEADS - h:] for t in views]).contiguous()  # a helper chunk
        helper_out = run(slot[0:1], slot[1:2], slot[2:3])
        exact_root = torch.equal(root_out, full[:, :h])
        exact_helper = torch.equal(helper_out, full[:, HEADS - h:])
        diff = max(float((root_out.float() - full[:, :h].float()).abs().max()),
                   float((helper_out.float() - full[:, HEADS - h:].float()).abs().max()))
        cases.append(dict(backend=name, seq_len=seq_len, heads=h, sms=sms,
                          exact=exact_root and exact_helper, exact_root_views=exact_root,
                          exact_contiguous_chunk=exact_helper, max_abs_diff=diff))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("split_exactness.json"))
    parser.add_argument("--write-range", type=Path, default=None,
                        help="write the derived thresholds into this exact_range.json")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.dry_run:
        device, dtype, sizes, sms = torch.device("cpu"), torch.float32, (96, 160), 1
    else:
        device, dtype = torch.device(args.device), torch.bfloat16
        sizes = tuple(int(s) for s in args.sizes.split(","))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    runs = backends_under_test(device)
    comfy_run, comfy_what = comfyui_attention()
    cases, errors = [], {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        for seq_len in sizes:
            views = strided_qkv(seq_len, device, dtype)
            for name, context in [*runs.items(), ("comfyui", contextlib.nullcontext)]:
                if name == "math" and seq_len > MATH_MAX_S:
                    continue

                def run(q, k, v, name=name):
                    if name == "comfyui":
                        return comfy_run(q, k, v)
                    return F.scaled_dot_product_attention(q, k, v)

                try:
                    with context():
                        found = sweep_one(name, run, views, sms, seq_len)
                except RuntimeError as exc:  # a backend this GPU/torch cannot run
                    errors[f"{name}@{seq_len}"] = str(exc).splitlines()[0][:200]
                    continue
                cases += found
                print(json.dumps({"backend": name, "S": seq_len,
                                  "inexact_heads": [c["heads"] for c in found if not c["exact"]]}),
                      flush=True)
            del views
            if device.type == "cuda":
                torch.cuda.empty_cache()
    names = sorted({c["backend"] for c in cases})
    derived = {n: derive_per_sm([c for c in cases if c["backend"] == n]) for n in names}
    predicted = sdpa_backend(device, dtype, HEAD_DIM) if device.type == "cuda" else "cpu"
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(sys.argv), torch=torch.__version__, device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                  else "cpu", sms=sms, comfyui_function=comfy_what,
                  predicted_comfyui_backend=predicted, min_heads_x_rows_per_sm=derived,
                  errors=errors, cases=cases, wall_s=round(time.perf_counter() - started, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.write_range is not None:
        write_range(args.write_range, report)
    print("| backend | S | inexact head subsets | threshold (heads x rows / SM) |")
    print("|---|---|---|---|")
    for name in names:
        for seq_len in sizes:
            found = [c for c in cases if c["backend"] == name and c["seq_len"] == seq_len]
            if found:
                bad = [c["heads"] for c in found if not c["exact"]] or "none"
                print(f"| {name} | {seq_len:,} | {bad} | {derived[name]} |")
    print(f"ComfyUI's function: {comfy_what} (predicted backend {predicted}); errors {errors}; "
          f"wall {report['wall_s']} s; json {args.out}")
    return 0


def write_range(path: Path, report: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {"backends": {}}
    measured = report["min_heads_x_rows_per_sm"]
    for name, value in measured.items():
        if name == "comfyui":
            continue
        if name == report["predicted_comfyui_backend"] and "comfyui" in measured:
            # ComfyUI's own call picks its kernel by priority: keep the stricter of the two
            both = (value, measured["comfyui"])
            value = None if None in both else max(both)
        data["backends"][name] = {"min_heads_x_rows_per_sm": value}
    data["source"] = (f"measured {report['date']} on {report['device_name']} ({report['sms']} "
                      f"SMs), torch {report['torch']}, bf16 [1, 56, S, 128], S "
                      f"{sorted({c['seq_len'] for c in report['cases']})}, subsets {SUBSETS} "
                      f"(dev/bench/bench_split_exactness.py)")
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
