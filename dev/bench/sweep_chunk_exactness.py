"""Where activation chunking is bit-identical on this GPU: rows per GEMM call, heads per attention.

Chunking computes rows [a, b) of every big GEMM as its own call, and attention over g heads per
call. On a GPU the result equals the unchunked call only while the library keeps the same kernel
(same K-reduction order, no split-K / split-KV): this sweep measures where that holds.

GEMMs (bf16, no bias, `F.linear` as ComfyUI's layers call it): H3's qkv_proj 5376->21504,
out_proj 7168->5376, fc1 5376->28672, fc2 14336->5376, and each one's LoRA adapter GEMMs (down
K->r, up r->N) for the ranks asked. For every chunk size m and offset (first rows, last rows) the
m-row call is compared with the same rows of one whole call over S rows, for each S >= m (the
unchunked pass lengths). Attention (ComfyUI's `optimized_attention` when ComfyUI imports, else
SDPA with ComfyUI's backend priority FLASH > CUDNN > EFFICIENT > MATH) runs on H3's strided
[1, H, S, D] views of one qkv buffer: g heads per call against one 56-head call.

The summary gives the smallest rows per call from which every tested size is exact against every
tested S (per shape and over all), and the smallest (heads x 64-row query tiles) per attention
call from which every tested group is exact: compare with `chunking.sizing.EXACT_MIN_ROWS` and
`MIN_QUERY_TILES_PER_CALL`. JSON to --out; a short table printed last. About 30 s on an H200.
`--write-range chunking/exact_rows.json` merges this GPU's per-shape floors into the table
chunking and the sequence mode read at run time (`chunking/exact_rows.py`); with `--from
SWEEP.json` it does so from an earlier sweep's JSON, without measuring.

    COMFYUI_PATH=/path/ComfyUI python dev/bench/sweep_chunk_exactness.py --out $OUT/exactness.json \
        --write-range chunking/exact_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, HEADS, HEAD_DIM, FFN = 5376, 56, 128, 14336
INNER = HEADS * HEAD_DIM
SHAPES = {  # name: (in_features K, out_features N)
    "qkv_proj": (HIDDEN, 3 * INNER),
    "out_proj": (INNER, HIDDEN),
    "fc1": (HIDDEN, 2 * FFN),
    "fc2": (FFN, HIDDEN),
}
ROWS = (256, 512, 777, 1000, 1024, 1536, 2048, 2300, 2560, 3072, 3328, 3584, 3968, 4096, 4224,
        5000, 6144, 8192, 12288, 16384, 32768)
# unchunked lengths: the lead's 3,320-token test, PASS1/PASS2 lengths of 5 / 10 / 15 s jobs
REFS = (3320, 8448, 16640, 35561, 68962, 102363)
ATTN_TOKENS = (3320, 8448, 16640, 35561)
HEADS_PER_CALL = (1, 2, 3, 4, 5, 7, 8, 12, 14, 16, 20, 28)
QUERY_TILE = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--refs", type=int, nargs="+", default=list(REFS))
    p.add_argument("--lora-ranks", type=int, nargs="*", default=[128, 32])
    p.add_argument("--attn-tokens", type=int, nargs="*", default=list(ATTN_TOKENS))
    p.add_argument("--heads-per-call", type=int, nargs="*", default=list(HEADS_PER_CALL))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, shapes / 16 and a few sizes: checks the script, measures nothing")
    p.add_argument("--attention", choices=["auto", "comfyui", "sdpa"], default="auto",
                   help="auto: ComfyUI's optimized_attention when COMFYUI_PATH imports")
    p.add_argument("--out", type=Path,
                   default=Path(os.environ.get("OUT", ".")) / "chunk_exactness.json")
    p.add_argument("--write-range", type=Path, default=None,
                   help="merge the measured floors per GEMM shape into this table "
                        "(chunking/exact_rows.json)")
    p.add_argument("--from", dest="from_json", type=Path, default=None,
                   help="with --write-range: take the floors from this sweep JSON, measure nothing")
    return p.parse_args(argv)


def write_range(path: Path, report: dict) -> dict:
    """Merge one sweep's floors into the table: devices[GPU][dtype] = {"K->N": rows or None}.

    Several GEMMs of one shape (qkv_proj's and fc1's rank-r down projections are both K->r)
    keep the strictest floor; None (no measured size was exact) wins."""
    floors: dict[str, int | None] = {}
    for name, entry in report["gemms"].items():
        shape = name.split()[-1]
        value = entry["min_exact_rows"]
        if shape not in floors:
            floors[shape] = value
        elif floors[shape] is not None:
            floors[shape] = None if value is None else max(floors[shape], value)
    meta = report["meta"]
    args = meta.get("args", {})
    source = (f"measured on {meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
              f"bf16 F.linear without bias; slices of {args.get('rows', '?')} rows against "
              f"whole calls of {args.get('refs', '?')} rows, first and last rows "
              f"(dev/bench/sweep_chunk_exactness.py)")
    data = json.loads(path.read_text()) if path.exists() else {}
    data["about"] = (
        "Fewest rows per call from which every measured row slice of a GEMM (\"K->N\": "
        "reduction K, output width N) equals the same rows of the whole call bit for bit, per "
        "GPU model (torch.cuda.get_device_name) and dtype; null: no measured slice size was. "
        "Read by chunking/exact_rows.py (the rule is in its docstring). Regenerate on the GPU: "
        "python dev/bench/sweep_chunk_exactness.py --write-range chunking/exact_rows.json")
    data.setdefault("devices", {}).setdefault(meta["device"], {})["bfloat16"] = {
        "source": source, "floors": dict(sorted(floors.items()))}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return floors


# ------------------------------------------------------------------------------------ GEMMs
def gemm_sweep(k: int, n: int, rows: list[int], refs: list[int], device, gen) -> list[dict]:
    """Per chunk size and offset: exact against each whole call of S rows, and max |diff|."""
    s_max = max(refs)
    x = torch.randn((s_max, k), device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn((n, k), device=device, dtype=torch.float32, generator=gen)
         / k ** 0.5).to(torch.bfloat16)
    results = []
    wholes = {s: F.linear(x[:s], w) for s in refs}
    for m in rows:
        first = F.linear(x[:m], w) if m < s_max else None  # the same call for every S
        for where in ("first", "last"):
            entry = {"rows": m, "offset": where, "exact_vs": {}, "max_abs_diff": 0.0}
            for s, whole in wholes.items():
                if s <= m:
                    continue
                a = 0 if where == "first" else s - m
                part = first if where == "first" else F.linear(x[a:a + m], w)
                same = bool(torch.equal(part, whole[a:a + m]))
                entry["exact_vs"][str(s)] = same
                if not same:
                    diff = (part.float() - whole[a:a + m].float()).abs().max().item()
                    entry["max_abs_diff"] = max(entry["max_abs_diff"], diff)
                del part
            if entry["exact_vs"]:
                results.append(entry)
        del first
    del wholes, x, w
    return results


def min_exact_rows(entries: list[dict]) -> int | None:
    """Smallest m such that every tested size >= m is exact against every S (None: none)."""
    sizes = sorted({e["rows"] for e in entries})
    exact = {m: all(all(e["exact_vs"].values()) for e in entries if e["rows"] == m)
             for m in sizes}
    best = None
    for m in reversed(sizes):
        if not exact[m]:
            break
        best = m
    return best


# ------------------------------------------------------------------------------------ attention
def attention_function(kind: str):
    """(name, fn(q, k, v, heads) -> [1, S, heads*D]) as the chunked block calls attention."""
    if kind in ("auto", "comfyui") and os.environ.get("COMFYUI_PATH"):
        try:
            sys.path.insert(0, os.environ["COMFYUI_PATH"])
            import comfy.cli_args

            if not torch.cuda.is_available():
                comfy.cli_args.args.cpu = True  # model_management refuses a GPU-less import
            import comfy.ldm.modules.attention as attention

            fn = attention.optimized_attention

            def comfy_call(q, k, v, heads):
                return fn(q, k, v, heads, mask=None, skip_reshape=True)

            return f"comfyui:{getattr(fn, '__name__', 'optimized_attention')}", comfy_call
        except Exception as exc:  # noqa: BLE001 - any import failure falls back to SDPA
            if kind == "comfyui":
                raise
            print(f"ComfyUI attention unavailable ({type(exc).__name__}: {exc}); using SDPA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def sdpa_call(q, k, v, heads):
        try:
            ctx = sdpa_kernel(order, set_priority=True)
        except TypeError:  # older torch: no priority order
            ctx = sdpa_kernel(order)
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(1, q.shape[2], heads * q.shape[3])

    return "sdpa:flash>cudnn>efficient>math", sdpa_call


def attention_sweep(fn, tokens: list[int], groups: list[int], device, gen,
                    heads: int = HEADS) -> list[dict]:
    inner = heads * HEAD_DIM
    results = []
    for s in tokens:
        qkv = torch.randn((s, 3 * inner), device=device, dtype=torch.bfloat16, generator=gen)
        q, k, v = (t.view(s, heads, HEAD_DIM).transpose(0, 1).unsqueeze(0)
                   for t in qkv.split(inner, dim=-1))
        whole = fn(q, k, v, heads)[0]
        tiles = -(-s // QUERY_TILE)
        for g in groups:
            for h0 in range(0, heads, g):
                h1 = min(h0 + g, heads)
                part = fn(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], h1 - h0)[0]
                ref = whole[:, h0 * HEAD_DIM:h1 * HEAD_DIM]
                same = bool(torch.equal(part, ref))
                results.append({"tokens": s, "heads_per_call": h1 - h0, "group": g,
                                "first_head": h0, "work_items": (h1 - h0) * tiles,
                                "exact": same,
                                "max_abs_diff": 0.0 if same else
                                (part.float() - ref.float()).abs().max().item()})
                del part
        del qkv, whole
    return results


def min_exact_work_items(entries: list[dict]) -> int | None:
    """Smallest heads x query tiles per call from which every tested call is exact."""
    items = sorted({e["work_items"] for e in entries})
    exact = {i: all(e["exact"] for e in entries if e["work_items"] == i) for i in items}
    best = None
    for i in reversed(items):
        if not exact[i]:
            break
        best = i
    return best


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        if args.write_range is None:
            print("--from needs --write-range")
            return 2
        floors = write_range(args.write_range, json.loads(args.from_json.read_text()))
        print(f"wrote {len(floors)} shapes from {args.from_json} into {args.write_range}")
        return 0
    shapes, heads = SHAPES, HEADS
    if args.dry_run:
        args.device, args.rows, args.refs, args.lora_ranks = "cpu", [64, 100], [160, 256], [8]
        args.attn_tokens, args.heads_per_call = [130], [2, 3]
        shapes = {name: (k // 16, n // 16) for name, (k, n) in SHAPES.items()}
        heads = 4
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU: this sweep measures GPU kernels")
        return 2
    began = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cuda": torch.version.cuda, "args": {k: str(v) for k, v in vars(args).items()}}
    rows = sorted(args.rows)
    gemms: dict[str, dict] = {}
    for name, (k, n) in shapes.items():
        entries = gemm_sweep(k, n, rows, args.refs, device, gen)
        gemms[f"{name} {k}->{n}"] = {"entries": entries, "min_exact_rows": min_exact_rows(entries)}
        for rank in args.lora_ranks:
            for part, (kk, nn) in (("lora_down", (k, rank)), ("lora_up", (rank, n))):
                entries = gemm_sweep(kk, nn, rows, args.refs, device, gen)
                gemms[f"{name} {part} {kk}->{nn}"] = {"entries": entries,
                                                      "min_exact_rows": min_exact_rows(entries)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name, fn = attention_function(args.attention)
    attn = attention_sweep(fn, args.attn_tokens, args.heads_per_call, device, gen, heads)
    floors = [g["min_exact_rows"] for g in gemms.values()]
    summary = {
        "min_exact_rows_all_gemms": None if None in floors else max(floors),
        "min_exact_rows_base_gemms": max((gemms[k]["min_exact_rows"] or 1 << 30)
                                         for k in gemms if "lora" not in k),
        "attention_function": name,
        "min_exact_work_items_per_attention_call": min_exact_work_items(attn),
        "min_exact_heads_per_call_by_tokens": {
            str(s): min((e["heads_per_call"] for e in attn if e["tokens"] == s
                         and all(f["exact"] for f in attn if f["tokens"] == s
                                 and f["heads_per_call"] >= e["heads_per_call"])),
                        default=None)
            for s in args.attn_tokens},
        "seconds": time.perf_counter() - began,
    }
    out = {"meta": meta, "summary": summary, "gemms": gemms, "attention": attn}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'GEMM':34s} {'exact from rows':>16s}  inexact sizes (max |diff|)")
    for key, g in gemms.items():
        bad = sorted({(e['rows'], round(e['max_abs_diff'], 4)) for e in g["entries"]
                      if not all(e["exact_vs"].values())})
        shown = ", ".join(f"{m} ({d})" for m, d in bad[:6]) + (" ..." if len(bad) > 6 else "")
        print(f"{key:34s} {str(g['min_exact_rows']):>16s}  {shown or '-'}")
    print(f"attention ({name}): exact from {summary['min_exact_work_items_per_attention_call']} "
          f"heads x 64-row tiles per call; min exact heads per call by tokens: "
          f"{summary['min_exact_heads_per_call_by_tokens']}")
    print(json.dumps({k: v for k, v in summary.items() if k != 'seconds'}))
    if args.write_range is not None and not args.dry_run:
        write_range(args.write_range, out)
        print(f"merged the floors into {args.write_range}")
    print(f"wrote {args.out} in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
