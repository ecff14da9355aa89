"""Where splitting work keeps results bit-identical on this GPU: GEMM rows and attention heads.

Every multi-GPU or chunked path of the pack relies on two facts that hold only for some shapes:
1. a linear's output rows do not depend on how many rows are multiplied together (row chunks,
   sequence-parallel shares) -- true only while the BLAS library keeps the same kernel and
   reduction order for the smaller row count;
2. attention heads are independent (head groups, Dual-Sage shards, sequence-parallel head
   shares) -- true only while the attention kernel does not change with the head count.

This sweep measures both for H3's shapes in bf16 and writes one JSON file; the defaults of
chunking, Dual-Sage and sequence parallel are chosen inside the ranges it reports as exact.

    python dev/bench/sweep_exactness.py --out results/exactness.json [--device cuda:0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

# H3's four block linears: (in, out)
LINEARS = {"qkv_proj": (5376, 21504), "out_proj": (7168, 5376), "fc1": (5376, 28672),
           "fc2": (14336, 5376)}
ROW_CHUNKS = (64, 256, 333, 512, 777, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)
HEADS, HEAD_DIM = 56, 128
HEAD_SUBSETS = (28, 14, 8, 4, 1)


def _sdpa_context(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
             "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}
    if backend == "comfy_priority":  # ComfyUI's order: flash, cuDNN, efficient, math
        order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        try:
            return sdpa_kernel(order, set_priority=True)
        except TypeError:
            return sdpa_kernel(order)
    if backend == "default":
        return nullcontext()
    return sdpa_kernel(table[backend])


def sweep_rows(device: torch.device, lengths: tuple[int, ...]) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (k, n) in LINEARS.items():
        weight = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        for seq in lengths:
            x = torch.randn(seq, k, device=device, generator=gen).to(torch.bfloat16)
            full = F.linear(x, weight)
            again = F.linear(x, weight)
            splits = [(f"chunk{c}", c) for c in ROW_CHUNKS if c < seq]
            splits.append(("half", (seq + 1) // 2))
            splits.append(("third", (seq + 2) // 3))
            for label, size in splits:
                parts = [F.linear(x[i:i + size], weight) for i in range(0, seq, size)]
                out = torch.cat(parts)
                diff = (out.float() - full.float()).abs().max().item()
                rows.append({"linear": name, "S": seq, "split": label, "rows": size,
                             "last_rows": seq - size * ((seq - 1) // size),
                             "exact": diff == 0.0, "max_abs_diff": diff})
            rows.append({"linear": name, "S": seq, "split": "repeat", "rows": seq,
                         "exact": bool(torch.equal(full, again)),
                         "max_abs_diff": (full.float() - again.float()).abs().max().item()})
            del x, full, again
        del weight
        torch.cuda.empty_cache()
    return rows


def sweep_heads(device: torch.device, lengths: tuple[int, ...], backends: tuple[str, ...]
                ) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    inner = HEADS * HEAD_DIM
    for seq in lengths:
        # H3's layout: q, k, v are strided [1, H, S, D] views of one [S, 3*H*D] buffer
        qkv = torch.randn(seq, 3 * inner, device=device, generator=gen).to(torch.bfloat16)
        q, k, v = (t.view(seq, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
                   for t in qkv.split(inner, dim=-1))
        for backend in backends:
            if backend == "math" and seq > 8192:
                continue
            try:
                with _sdpa_context(backend):
                    full = F.scaled_dot_product_attention(q, k, v)
                    again = F.scaled_dot_product_attention(q, k, v)
                    for sub in HEAD_SUBSETS:
                        for layout in ("strided", "contiguous"):
                            for start in sorted({0, HEADS - sub}):
                                sl = slice(start, start + sub)
                                qs, ks, vs = q[:, sl], k[:, sl], v[:, sl]
                                if layout == "contiguous":
                                    qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
                                out = F.scaled_dot_product_attention(qs, ks, vs)
                                diff = (out.float() - full[:, sl].float()).abs().max().item()
                                rows.append({"backend": backend, "S": seq, "heads": sub,
                                             "start": start, "layout": layout,
                                             "exact": diff == 0.0, "max_abs_diff": diff})
                rows.append({"backend": backend, "S": seq, "heads": HEADS, "layout": "repeat",
                             "exact": bool(torch.equal(full, again))})
            except RuntimeError as exc:
                rows.append({"backend": backend, "S": seq, "error": str(exc)[:200]})
            torch.cuda.empty_cache()
        del qkv, q, k, v
    return rows


def summarize(rows_gemm: list[dict], rows_attn: list[dict]) -> list[str]:
    lines = ["GEMM row splits (bf16): smallest exact chunk per linear and S, and inexact chunks"]
    for name in LINEARS:
        for seq in sorted({r["S"] for r in rows_gemm}):
            sel = [r for r in rows_gemm if r["linear"] == name and r["S"] == seq
                   and r["split"] != "repeat"]
            bad = [r["rows"] for r in sel if not r["exact"]]
            lines.append(f"  {name:9s} S={seq:6d} inexact rows: {bad or 'none'}")
    lines.append("attention head subsets (bf16, 128-dim): inexact cases")
    for backend in sorted({r["backend"] for r in rows_attn}):
        sel = [r for r in rows_attn if r["backend"] == backend and "error" not in r
               and r.get("layout") != "repeat"]
        bad = sorted({(r["S"], r["heads"], r["layout"]) for r in sel if not r["exact"]})
        errs = [r["S"] for r in rows_attn if r["backend"] == backend and "error" in r]
        lines.append(f"  {backend:14s} {len(sel)} cases, inexact {bad or 'none'}"
                     + (f", errors at S={errs}" if errs else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--quick", action="store_true", help="fewer lengths")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    gemm_lengths = (3320, 15399) if args.quick else (3320, 15399, 35305)
    attn_lengths = (3320, 4096, 15399) if args.quick else (3320, 4096, 15399, 35305)
    backends = ("comfy_priority", "default", "flash", "cudnn", "efficient", "math")
    start = time.time()
    rows_gemm = sweep_rows(device, gemm_lengths)
    rows_attn = sweep_heads(device, attn_lengths, backends)
    result = {"what": "bit-identity of row-split bf16 GEMMs (H3 linears) and head-subset "
                      "attention (56x128 heads) against the unsplit call",
              "date": time.strftime("%Y-%m-%d"), "machine": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "seconds": round(time.time() - start, 1),
              "gemm": rows_gemm, "attention": rows_attn}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print("\n".join(summarize(rows_gemm, rows_attn)))


if __name__ == "__main__":
    main()
