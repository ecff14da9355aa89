"""Check the planner's memory model against a real GPU: one full-size twin forward per case.

For PASS1 864x480 at 243 frames and PASS2 1312x736 at 124 and 243 frames, run one forward of the
bf16 full-size twin with all 50 blocks resident on one GPU and compare
`torch.cuda.max_memory_allocated` with the planner's predictions:
- activation peak: measured peak minus what was allocated before the forward (weights, inputs);
- total peak: predicted weights (planner/components.bf16_sizes) + predicted activation peak.

Usage (device machine): python dev/bench/bench_memory_model.py --out $OUT/memory_model.json
CPU smoke test:         python dev/bench/bench_memory_model.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from h3_multigpu.chunking.sizing import Kernels
from h3_multigpu.common import geometry
from h3_multigpu.planner import BlockDims, bf16_sizes, block_activation_peak

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the twin lives in tests/
from twin import TwinConfig, make_inputs, make_twin  # noqa: E402

TWIN_KERNELS = Kernels(mlp="twin", attention_output_copy=False)
CASES = [("PASS1", 864, 480, 243), ("PASS2", 1312, 736, 124), ("PASS2", 1312, 736, 243)]
TEXT_TOKENS = 256


def run(dry_run: bool, device: str) -> dict:
    cfg = TwinConfig.tiny() if dry_run else TwinConfig.full()
    dims = BlockDims(cfg.hidden, cfg.heads, cfg.head_dim, cfg.ffn)
    dev = torch.device(device)
    t0 = time.perf_counter()
    model = make_twin(cfg, dtype=torch.bfloat16, device=dev, init_on_device=True)
    build_s = time.perf_counter() - t0
    weights_measured = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    weights_predicted = bf16_sizes().dit_bytes if not dry_run else weights_measured
    rows = []
    cases = [("tiny", 64, 64, 22)] if dry_run else CASES
    for name, w, h, frames in cases:
        _, _, t, lh, lw = geometry.latent_shape(w, h, frames)
        audio_t = geometry.audio_latent_steps(frames)
        x, ts, ctx = make_inputs(cfg, latent_t=t, latent_h=lh, latent_w=lw, audio_t=audio_t,
                                 text_len=TEXT_TOKENS, dtype=torch.bfloat16, device=dev)
        tokens = geometry.video_audio_tokens(w, h, frames) + TEXT_TOKENS
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model(x, ts, ctx)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
        else:
            before = peak = 0
        elapsed = time.perf_counter() - start
        # the bench runs the twin, whose SwiGLU and SDPA output layout are its own
        predicted = block_activation_peak(tokens, dims, kernels=TWIN_KERNELS)
        act_measured = peak - before
        row = {
            "case": f"{name} {w}x{h} {frames}f", "tokens": tokens, "forward_s": elapsed,
            "activation_predicted_GiB": predicted.peak_bytes / 2**30,
            "activation_measured_GiB": act_measured / 2**30,
            "activation_ratio": act_measured / predicted.peak_bytes if act_measured else None,
            "peak_phase_predicted": predicted.phase,
            "total_predicted_GiB": (weights_predicted + predicted.peak_bytes) / 2**30,
            "total_measured_GiB": peak / 2**30,
            "total_ratio": peak / (weights_predicted + predicted.peak_bytes) if peak else None,
            "finite": bool(torch.isfinite(out[0]).all()),
        }
        rows.append(row)
        del out, x, ctx
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "build_s": build_s,
            "weights_measured_GiB": weights_measured / 2**30,
            "weights_predicted_GiB": weights_predicted / 2**30, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny twin on the CPU")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args.dry_run, "cpu" if args.dry_run else args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"weights: predicted {result['weights_predicted_GiB']:.2f} GiB, measured "
          f"{result['weights_measured_GiB']:.2f} GiB")
    print(f"{'case':<24} {'tokens':>8} {'act pred':>9} {'act meas':>9} {'ratio':>6} "
          f"{'tot pred':>9} {'tot meas':>9} {'ratio':>6}")
    for r in result["rows"]:
        ar = f"{r['activation_ratio']:.3f}" if r["activation_ratio"] else "-"
        tr = f"{r['total_ratio']:.3f}" if r["total_ratio"] else "-"
        print(f"{r['case']:<24} {r['tokens']:>8} {r['activation_predicted_GiB']:>9.2f} "
              f"{r['activation_measured_GiB']:>9.2f} {ar:>6} {r['total_predicted_GiB']:>9.2f} "
              f"{r['total_measured_GiB']:>9.2f} {tr:>6}")


if __name__ == "__main__":
    main()
