"""When is a head subset of ComfyUI's CPU attention bit-identical to the whole call? ~5 min.

    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_split_exactness_cpu.py \
        --out split_exactness_cpu.json [--write-range common/exact_range.json]

Dual-Sage and the sequence mode run ComfyUI's attention function once per head subset. On a
GPU `bench_split_exactness.py` measures that; this one measures the CPU (the test stand-in, and
what `--cpu` users run): ComfyUI's own functions `attention_sub_quad` (its CPU default),
`attention_pytorch` (`--use-pytorch-cross-attention`) and `attention_basic`, over H3's strided
`[1, H, S, 128]` views of one qkv buffer, fp32 and bf16, with torch using 1, 2 and 4 threads.
Every subset size h < H is run at the first, middle and last heads and compared with the same
heads of the whole call. The JSON lists the inexact cases and the rule `exact_range.json`'s
"cpu" entry stores: the fewest heads a subset needs to be exact with one thread and with more.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

HEAD_DIM = 128
HEADS = (2, 4, 8, 56)
SIZES = tuple(range(8, 72)) + (100, 160, 333, 1000, 2049)
SIZES_56 = (9, 44, 100, 333)  # H3's own head count: a few lengths and subset sizes
SUBSETS_56 = (1, 2, 3, 4, 7, 8, 14, 28, 55)
THREADS = (1, 2, 4)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FUNCTIONS = ("attention_sub_quad", "attention_pytorch", "attention_basic")


def comfy_attention():
    root = os.environ.get("COMFYUI_PATH")
    if not root:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout (its attention is measured)")
    sys.path.insert(0, root)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # ComfyUI's CPU defaults, as `--cpu` sets them
    from comfy.ldm.modules import attention

    return attention


def strided(heads: int, seq_len: int, dtype: torch.dtype, seed: int):
    """q, k, v as H3 hands them over: [1, H, S, D] views of one [S, 3, H, D] buffer."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn((seq_len, 3, heads, HEAD_DIM), generator=gen).to(dtype)
    return tuple(qkv[:, i].transpose(0, 1).unsqueeze(0) for i in range(3))


def inexact_subsets(fn, heads: int, seq_len: int, dtype: torch.dtype) -> list[int]:
    q, k, v = strided(heads, seq_len, dtype, seed=seq_len * 1000 + heads)
    whole = fn(q, k, v, heads, skip_reshape=True)
    bad = []
    for n in (SUBSETS_56 if heads == 56 else range(1, heads)):
        for a in sorted({0, (heads - n) // 2, heads - n}):
            part = fn(q[:, a:a + n], k[:, a:a + n], v[:, a:a + n], n, skip_reshape=True)
            if not torch.equal(part, whole[:, :, a * HEAD_DIM:(a + n) * HEAD_DIM]):
                bad.append(n)
                break
    return bad


def derive(cases: list[dict]) -> dict:
    """Fewest heads from which every measured subset was exact, one thread and more."""
    def fewest(rows):
        worst = max((n for c in rows for n in c["inexact"]), default=0)
        return worst + 1

    return {"min_heads_one_thread": fewest([c for c in cases if c["threads"] == 1]),
            "min_heads": fewest([c for c in cases if c["threads"] > 1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("split_exactness_cpu.json"))
    parser.add_argument("--write-range", type=Path, default=None,
                        help="update the 'cpu' entry of common/exact_range.json")
    parser.add_argument("--quick", action="store_true", help="a few sizes only (smoke run)")
    args = parser.parse_args()
    attention = comfy_attention()
    sizes = (9, 44, 100, 333) if args.quick else SIZES
    cases = []
    for name in FUNCTIONS:
        fn = getattr(attention, name)
        for dtype_name, dtype in DTYPES.items():
            for threads in THREADS:
                torch.set_num_threads(threads)
                for heads in HEADS:
                    for seq_len in (sizes if heads < 56 or args.quick else SIZES_56):
                        if heads * seq_len > 56 * 1024:
                            continue
                        bad = inexact_subsets(fn, heads, seq_len, dtype)
                        cases.append({"function": name, "dtype": dtype_name, "threads": threads,
                                      "heads": heads, "seq_len": seq_len, "inexact": bad})
                flagged = sorted({n for c in cases if c["function"] == name
                                  and c["dtype"] == dtype_name and c["threads"] == threads
                                  for n in c["inexact"]})
                print(f"{name:20s} {dtype_name:9s} {threads} threads: inexact subset sizes "
                      f"{flagged or 'none'}", flush=True)
    rule = derive(cases)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    long = ", ".join(map(str, SIZES_56))
    source = (f"measured {when} on {platform.machine()} "
              f"{platform.processor() or platform.platform()}, torch {torch.__version__}, "
              f"ComfyUI {', '.join(FUNCTIONS)}, fp32/bf16 [1, H, S, 128] strided views, H "
              f"{HEADS}, S {min(sizes)}..{max(sizes)} ({long} for 56 heads), threads {THREADS} "
              "(dev/bench/bench_split_exactness_cpu.py)")
    report = {"source": source, "rule": rule,
              "inexact_cases": [c for c in cases if c["inexact"]], "cases": len(cases)}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"rule: {rule}  ({len(report['inexact_cases'])} of {len(cases)} cases inexact)")
    if args.write_range is not None:
        data = json.loads(args.write_range.read_text())
        data["cpu"] = {**rule, "source": source}
        args.write_range.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote the cpu entry of {args.write_range}")


if __name__ == "__main__":
    main()
