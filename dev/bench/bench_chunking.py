"""Benchmark: FFN/QKV chunking on one GPU capped at 32 GiB, PASS2 1312x736 at 10 / 12 / 15 s.

What it measures: one full-size DiT block (or `--blocks` of them) of the twin in bf16 with a
rank-128 on-activation LoRA on qkv_proj and fc1, fed the packed sequence of PASS2 at 243, 294
and 362 frames (S = 68,706 / 83,021 / 102,107 + text). Per case: time per block, the block's
activation peak (`torch.cuda.max_memory_allocated` above what was allocated before, x
included), the prediction of `chunking/sizing.py` for the same settings, and whether the output
is bit-identical to the unchunked block's. An out-of-memory is a result, not a crash.

Why one block: per-block activation peak and per-block time are what chunking changes. The
other 49 blocks' weights would not fit a 32 GiB card in bf16 anyway; in the user's run they are
int8 and resident (19.53 GB DiT + 1.8 GiB turbo LoRA) or streamed by the prefetcher. The bench
reserves `--resident-gib` (default 20) of ballast for them, so the activations get what the
user's card had left: 362 frames without chunking must run out of memory as it did for the user.

Modes per frame count: "unchunked" (the block's own forward), "chunked" (fixed --ffn-chunk /
--qkv-chunk / --head-group rows), "auto" (sized at run time from free memory).

    python dev/bench/bench_chunking.py                 # on the device: writes $OUT/chunking.json
    python dev/bench/bench_chunking.py --dry-run       # tiny twin on the CPU, same code path
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, sizing
from h3_multigpu.common import geometry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the twin lives in tests/
from block_workload import (  # noqa: E402  (the tests' twin workloads)
    BlockWorkload,
    attention_output_needs_copy,
    chunked_forwards,
    make_block_model,
    pack_workload,
    pass_workload,
    release_cached,
    rms_norm_temporary_bytes,
    run_blocks,
)
from twin import TwinConfig, TwinPatcher  # noqa: E402

GiB = 1 << 30
MODES = ("unchunked", "chunked", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny twin on the CPU")
    p.add_argument("--frames", type=int, nargs="+", default=[243, 294, 362])
    p.add_argument("--width", type=int, default=1312)
    p.add_argument("--height", type=int, default=736)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--cap-gib", type=float, default=32.0, help="per-process GPU memory cap")
    p.add_argument("--resident-gib", type=float, default=20.0,
                   help="ballast standing for the other blocks' resident weights + LoRA")
    p.add_argument("--rank", type=int, default=128, help="LoRA rank on qkv_proj and fc1")
    p.add_argument("--blocks", type=int, default=1, help="full-size blocks run per case")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ffn-chunk", type=int, default=16384)
    p.add_argument("--qkv-chunk", type=int, default=16384)
    p.add_argument("--head-group", type=int, default=14)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "chunking.json")
    return p.parse_args(argv)


def _forwards(workload: BlockWorkload, mode: str, args: argparse.Namespace):
    model = workload.model
    if mode == "unchunked":
        return [block.forward for block in model.blocks]
    config = ChunkingConfig("auto", "auto", "auto") if mode == "auto" else ChunkingConfig(
        ffn_chunk=args.ffn_chunk, qkv_chunk=args.qkv_chunk, head_group=args.head_group)
    return chunked_forwards(apply_activation_chunking(TwinPatcher(model), config))


def _predict(workload: BlockWorkload, chunks: tuple[int, int, int], args,
             kernels: sizing.Kernels) -> sizing.BlockPeak:
    cfg = workload.model.cfg
    dims = sizing.BlockDims(hidden=cfg.hidden, heads=cfg.heads, head_dim=cfg.head_dim,
                            ffn=cfg.ffn, element_bytes=workload.packed.h.element_size())
    adapters = sizing.Adapters(rank=args.rank, qkv=1, fc1=1) if args.rank else sizing.Adapters()
    ffn, qkv, group = chunks
    return sizing.block_peak_bytes(workload.tokens, dims, ffn_chunk=ffn, qkv_chunk=qkv,
                                   head_group=group, adapters=adapters, kernels=kernels)


def run_case(workload: BlockWorkload, frames: int, mode: str, args, kernels: sizing.Kernels,
             reference: torch.Tensor | None) -> tuple[dict, torch.Tensor | None]:
    row: dict = {"frames": frames, "tokens": workload.tokens, "mode": mode}
    try:
        forwards = _forwards(workload, mode, args)
        result = run_blocks(workload, forwards, repeats=args.repeats)
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:300])
        return row, None
    except Exception as err:  # any failure is this case's result; the other cases still run
        row.update(status="error", error=f"{type(err).__name__}: {err}"[:300],
                   traceback=traceback.format_exc()[-1500:])
        return row, None
    finally:
        release_cached(workload.packed.rope_freqs.device)
    chunks = getattr(forwards[0], "last_chunks", None) or (0, 0, 0)
    peak = _predict(workload, chunks, args, kernels)
    blocks = len(forwards)
    row.update(status="ok", ffn_chunk=chunks[0], qkv_chunk=chunks[1], head_group=chunks[2],
               predicted_peak_gib=peak.peak_bytes / GiB,
               predicted_attention_gib=peak.attention_bytes / GiB,
               predicted_mlp_gib=peak.mlp_bytes / GiB, predicted_phase=peak.phase)
    if result.seconds:
        per_block = sorted(result.seconds)[len(result.seconds) // 2] / blocks
        row.update(block_ms=per_block * 1000.0, step_s_50_blocks=per_block * 50)
    if result.activation_peak_bytes is not None:
        measured = result.activation_peak_bytes
        row.update(measured_peak_gib=measured / GiB,
                   prediction_error=(peak.peak_bytes - measured) / measured)
    if reference is not None:
        row["bit_identical"] = bool(torch.equal(result.output, reference))
        if not row["bit_identical"]:
            diff = (result.output.float() - reference.float()).abs()
            row["max_abs_diff"] = float(diff.max())
    return row, result.output


def _verdicts(rows: list[dict], frames: list[int], cuda: bool) -> dict:
    by = {(r["frames"], r["mode"]): r for r in rows}
    out: dict = {}
    longest = max(frames)
    fixed = by.get((longest, "chunked"), {})
    plain = by.get((longest, "unchunked"), {})
    out[f"{longest}f_chunked_completes"] = fixed.get("status") == "ok"
    out[f"{longest}f_unchunked_runs_out_of_memory"] = plain.get("status") == "oom"
    overheads = {}
    for f in frames:
        a, b = by.get((f, "unchunked"), {}), by.get((f, "chunked"), {})
        if a.get("block_ms") and b.get("block_ms"):
            overheads[f] = b["block_ms"] / a["block_ms"] - 1.0
    out["chunked_time_overhead"] = overheads
    out["chunked_within_3_percent"] = bool(overheads) and all(v <= 0.03 for v in
                                                              overheads.values())
    errors = [abs(r["prediction_error"]) for r in rows if "prediction_error" in r]
    out["max_prediction_error"] = max(errors) if errors else None
    out["prediction_within_10_percent"] = bool(errors) and max(errors) <= 0.10
    out["all_bit_identical"] = all(r.get("bit_identical", True) for r in rows)
    if not cuda:
        out["note"] = "dry run: no memory or timing on the CPU"
    return out


def _table(rows: list[dict]) -> str:
    head = (f"{'frames':>6} {'tokens':>7} {'mode':>9} {'status':>6} {'ffn/qkv/hg':>17} "
            f"{'ms/block':>9} {'meas GiB':>8} {'pred GiB':>8} {'err':>6} {'exact':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        chunks = (f"{r['ffn_chunk']}/{r['qkv_chunk']}/{r['head_group']}"
                  if r.get("status") == "ok" else "-")

        def num(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        lines.append(f"{r['frames']:>6} {r['tokens']:>7} {r['mode']:>9} {r['status']:>6} "
                     f"{chunks:>17} {num('block_ms', '9.1f'):>9} "
                     f"{num('measured_peak_gib', '8.2f'):>8} {num('predicted_peak_gib', '8.2f'):>8}"
                     f" {num('prediction_error', '+6.1%'):>6} "
                     f"{str(r.get('bit_identical', '-')):>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("no GPU: run with --dry-run for the CPU path", file=sys.stderr)
        return 2
    # set_per_process_memory_fraction needs an indexed device
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    meta: dict = {"torch": torch.__version__, "python": platform.python_version(),
                  "dry_run": args.dry_run, "args": {k: str(v) for k, v in vars(args).items()}}
    ballast = None
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
        meta.update(device=torch.cuda.get_device_name(device), cap_gib=args.cap_gib,
                    resident_gib=args.resident_gib)
        cfg = TwinConfig.full(blocks=args.blocks, refiner_blocks=0)
    else:
        cfg = TwinConfig.tiny(blocks=args.blocks, refiner_blocks=0)
        args.ffn_chunk, args.qkv_chunk, args.head_group, args.rank = 17, 13, 3, 4
    try:
        import comfy_kitchen  # noqa: F401  (the twin's in-place q/k norm + RoPE kernel)

        meta["comfy_kitchen"] = getattr(comfy_kitchen, "__version__", "present")
    except ImportError:
        meta["comfy_kitchen"] = "missing: the twin falls back to an fp32 reference rope"
    model, hooks = make_block_model(cfg, device=device, lora_rank=args.rank, seed=0)
    kernels = sizing.Kernels(
        mlp="twin",
        attention_output_copy=attention_output_needs_copy(device, heads=cfg.heads,
                                                          head_dim=cfg.head_dim),
        norm_temp_bytes=rms_norm_temporary_bytes(device, hidden=cfg.hidden))
    meta["kernels"] = {"attention_output_copy": kernels.attention_output_copy,
                       "norm_temp_bytes_per_element": kernels.norm_temp_bytes}
    rows: list[dict] = []
    for frames in args.frames:
        if cuda:
            workload = pass_workload(model, hooks, width=args.width, height=args.height,
                                     frames=frames, text_tokens=args.text_tokens)
        else:  # a tiny pass whose segments straddle the chunk borders
            workload = pack_workload(model, hooks, latent_t=2 + frames % 3, latent_h=4,
                                     latent_w=6, audio_t=5, text_tokens=16, seed=frames)
        if cuda and ballast is None:
            ballast = torch.empty(int(args.resident_gib * GiB), dtype=torch.uint8, device=device)
        reference = None
        for mode in MODES:
            row, output = run_case(workload, frames, mode, args, kernels, reference)
            if cuda and frames in (243, 294, 362):
                row["expected_tokens"] = geometry.video_audio_tokens(args.width, args.height,
                                                                     frames) + args.text_tokens
            rows.append(row)
            if reference is None and output is not None:
                reference = output  # the first mode that ran is what the others must equal
            print(_table([row]).splitlines()[-1], flush=True)
        del workload
        release_cached(device)
    verdicts = _verdicts(rows, args.frames, cuda)
    meta["seconds"] = round(time.time() - started, 1)
    report = {"meta": meta, "rows": rows, "verdicts": verdicts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print()
    print(_table(rows))
    print(json.dumps(verdicts, indent=2))
    print(f"wrote {args.out} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
