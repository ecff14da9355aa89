"""Benchmark: H3 video decode on all GPUs vs one GPU, through ComfyUI's own VAE.decode.

What it measures, at 1312x736 and 243 / 362 frames (latent 72 / 107 frames): ComfyUI's
unpatched `VAE.decode` of the upstream `MiniMaxH3VideoVAE` (the test-bed ComfyUI named by
COMFYUI_PATH; released config: 36 blocks, width 2048; random weights) on cuda:0, then the same
call on the VAE patched by `apply_multi_gpu_decode` (windows shared with every other GPU).
Per frame count: seconds (median of --repeats, the VAE already loaded), the speed-up, whether
the two videos are bit-identical (and the max difference if not), each GPU's peak
(`torch.cuda.max_memory_allocated`) next to the planner's prediction (`planner/decode.py`),
the windows per GPU, the boundary pieces handed over, the decoder copy's time and whether every
window decoded with the same tile batches. Target: >= 1.8x, bit-identical, peaks within 10%.

    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_decode.py --out $OUT/decode.json
    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_decode.py --dry-run   # tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

GiB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[243, 362])
    p.add_argument("--width", type=int, default=1312)
    p.add_argument("--height", type=int, default=736)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: stdout only)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny decoder on the CPU (helpers are the CPU too), same code path")
    return p.parse_args(argv)


def import_comfy():
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout with the H3 video VAE")
    sys.path.insert(0, path)
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    from comfy.ldm.minimax import vae as h3_vae

    return comfy.sd, h3_vae, comfy.ops, mm


def build_vae(comfy, dtype: torch.dtype, tiny: bool):
    """ComfyUI builds the VAE from a state dict through its H3 detection; random weights."""
    sd_mod, h3_vae, ops, mm = comfy
    sd = {"decoder.transformer_blocks.0.scale1": torch.ones(2048),
          "encoder.down.5.block.0.conv1.weight": torch.zeros(1024, 512, 3, 3, 3)}
    vae = sd_mod.VAE(sd=sd, dtype=dtype)
    model = vae.first_stage_model
    if tiny:
        model.decoder = h3_vae.ViT3DDecoder(num_layers=2, heads=2, dim_head=32,
                                            operations=ops.disable_weight_init)
        model.tile_size, model.tile_overlap_min = 64, 16
    device = vae.device
    model.to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("scale1", "scale2")):
                p.fill_(0.1)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
                        .mul_(0.02))
    return vae


def sync() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def reset_peaks() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)


def peaks() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    return {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / GiB
            for i in range(torch.cuda.device_count())}


def timed_decode(vae, latent, mm, repeats: int) -> tuple[torch.Tensor, list[float], dict]:
    mm.load_models_gpu([vae.patcher])  # loaded before the clock starts, as in a warm workflow
    seconds, out, top = [], None, {}
    for _ in range(repeats):
        out = None
        sync()
        reset_peaks()
        start = time.perf_counter()
        out = vae.decode(latent)
        sync()
        seconds.append(time.perf_counter() - start)
        top = peaks()
    return out, seconds, top


def run(args: argparse.Namespace) -> dict:
    from h3_multigpu.comfy_seam.h3 import tensor_bytes
    from h3_multigpu.decode.apply import MultiGPUDecodeConfig, apply_multi_gpu_decode, find_patch
    from h3_multigpu.decode.replica import replica_bytes
    from h3_multigpu.decode.windows import frames_to_latents
    from h3_multigpu.planner.decode import decode_memory

    comfy = import_comfy()
    mm = comfy[3]
    dtype = DTYPES[args.dtype] if not args.dry_run else torch.float32
    if args.dry_run:
        args.frames, args.width, args.height, args.repeats = [39, 56], 112, 96, 1
    started = time.perf_counter()
    vae = build_vae(comfy, dtype, tiny=args.dry_run)
    model = vae.first_stage_model
    weights = sum(tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
    config = MultiGPUDecodeConfig(helpers=("cpu",) if args.dry_run else None)
    patched, line = apply_multi_gpu_decode(vae, config)
    patch = find_patch(patched)
    result = {"what": "H3 video decode: ComfyUI's VAE.decode on one GPU vs windows shared "
                      "between GPUs (apply_multi_gpu_decode)",
              "machine": platform.node(), "torch": torch.__version__,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
              if torch.cuda.is_available() else [],
              "dtype": str(vae.vae_dtype), "width": args.width, "height": args.height,
              "weights_gib": weights / GiB, "decoder_copy_gib": replica_bytes(model) / GiB,
              "status": line, "dry_run": args.dry_run, "rows": []}
    h, w = args.height // 16, args.width // 16
    warm = torch.randn(1, 24, 12, h, w, generator=torch.Generator().manual_seed(1))
    timed_decode(vae, warm, mm, 1)  # kernels, allocator and the helpers' first copy
    timed_decode(patched, warm, mm, 1)
    result["setup_seconds"] = time.perf_counter() - started
    element = torch.finfo(vae.vae_dtype).bits // 8
    for frames in args.frames:
        t = frames_to_latents(frames)
        latent = torch.randn(1, 24, t, h, w, generator=torch.Generator().manual_seed(frames))
        one, one_s, one_peaks = timed_decode(vae, latent, mm, args.repeats)
        split, split_s, split_peaks = timed_decode(patched, latent, mm, args.repeats)
        exact = torch.equal(one, split)
        diff = 0.0 if exact else (one - split).abs().nan_to_num(float("inf")).max().item()
        report = patch.last_report
        memory = decode_memory(args.width, args.height, frames, weights, element)
        predicted_one = sum(memory["alone"]) / GiB
        predicted = {d: sum(memory["root" if k == 0 else "helper"]) / GiB
                     for k, d in enumerate(report.devices if report else [])}
        row = {
            "frames": frames, "latent_frames": t,
            "one_gpu_seconds": one_s, "split_seconds": split_s,
            "speedup": statistics.median(one_s) / statistics.median(split_s),
            "exact": exact, "max_abs_diff": diff, "finite": bool(one.isfinite().all()),
            "one_gpu_peak_gib": one_peaks.get("cuda:0"), "one_gpu_predicted_gib": predicted_one,
            "split_peak_gib": split_peaks, "split_predicted_gib": predicted,
            "devices": report.devices if report else [],
            "windows": report.windows if report else [],
            "handovers": report.handovers if report else 0,
            "copy_seconds": report.copy_seconds if report else {},
            "failed": report.failed if report else {},
            "same_tile_batches": report.same_tile_batches if report else None,
            "patch_line": patch.last_line,
        }
        result["rows"].append(row)
        del one, split
    result["seconds_total"] = time.perf_counter() - started
    return result


def table(result: dict) -> str:
    lines = [f"{'frames':>6} {'1 GPU s':>8} {'split s':>8} {'speedup':>7} {'exact':>5} "
             f"{'peak/pred per GPU (GiB)':<40} windows"]
    for r in result["rows"]:
        mem = [f"{r['one_gpu_peak_gib'] or 0:.2f}/{r['one_gpu_predicted_gib']:.2f}(1)"]
        for d in r["devices"]:
            got = r["split_peak_gib"].get(d)
            mem.append(f"{got or 0:.2f}/{r['split_predicted_gib'].get(d, 0):.2f}")
        lines.append(f"{r['frames']:>6} {statistics.median(r['one_gpu_seconds']):>8.2f} "
                     f"{statistics.median(r['split_seconds']):>8.2f} {r['speedup']:>6.2f}x "
                     f"{str(r['exact']):>5} {' '.join(mem):<40} {r['windows']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # as ComfyUI's executor runs every node: without it the decode records an autograd graph
    # (the VAE's parameters require grad) and one 12-latent-frame warm-up held 136 GiB
    with torch.inference_mode():
        result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        print(text)
    print(table(result))
    ok = all(r["exact"] for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
