"""One PASS2 model call on a real ComfyUI release, stock against the pack, in one process.

    python dev/bench/bench_release_step.py --out $OUT/step243.json          # 1312x736, 243 f
    python dev/bench/bench_release_step.py --frames 362 --cap-gib 32 --out $OUT/cap362.json
    python dev/bench/bench_release_step.py --size tiny --frames 5 --width 64 --height 64 \
        --out /tmp/tiny.json                                                    # CPU dry run

ComfyUI comes from $COMFYUI_PATH and is imported into this process; DynamicVRAM is switched on
the way ComfyUI's main.py does (comfy-aimdo, ModelPatcherDynamic) unless `--dynamic off` or no
CUDA. The DiT is a random-weight checkpoint in the official format (`--weights int8_convrot`:
minimax_h3_fl2va_pruned_int8_convrot, 932 tensors at full size), written to `--workdir` once and
loaded through ComfyUI's own loader (`comfy.sd.load_diffusion_model`, what UNETLoader runs).

Each variant is one sampler call of ComfyUI's own path (SamplerCustomAdvanced + BasicGuider,
sigmas 0.9 -> 0: one model call) on the same inputs, warmed up once, then timed `--reps` times:
- `stock`: the loaded patcher as UNETLoader returns it;
- `pack`: what the H3 Multi-GPU node applies to the model on this machine (its plan for this
  GPU, placement, device guard, the plan's features);
- `pack+chunking`: the same with activation chunking forced on (ffn/qkv/head groups auto).
Outputs are compared bit for bit with `stock`. `--cap-gib` emulates a card of that size: torch's
allocator is capped (`set_per_process_memory_fraction`), ComfyUI reserves the rest
(`--reserve-vram`), and comfy-aimdo keeps the rest as headroom.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
GIB = 1024 ** 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--weights", choices=("int8_convrot", "bf16"), default="int8_convrot")
    p.add_argument("--width", type=int, default=1312)
    p.add_argument("--height", type=int, default=736)
    p.add_argument("--frames", type=int, default=243)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--dynamic", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--cap-gib", type=float, default=None)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--variants", default="stock,pack,pack+chunking")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "h3_bench"))
    return p.parse_args(argv)


def latent_sizes(width: int, height: int, frames: int) -> tuple[tuple[int, int, int], int]:
    from h3_multigpu.common.geometry import audio_latent_steps, latent_frames

    return (latent_frames(frames), height // 16, width // 16), audio_latent_steps(frames)


def headroom_for_cap(cap_gib: float | None) -> int:
    """Bytes a card of `cap_gib` lacks against this GPU (0 without a cap)."""
    if cap_gib is None:
        return 0
    return max(0, torch.cuda.get_device_properties(0).total_memory - int(cap_gib * GIB))


def apply_cap(cap_gib: float) -> int:
    """Emulate a card of `cap_gib`: torch's allocator capped, ComfyUI reserving the rest."""
    import comfy.model_management as mm

    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(cap_gib * GIB)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    mm.EXTRA_RESERVED_VRAM = max(mm.EXTRA_RESERVED_VRAM, total - cap)
    return cap


def checkpoint(args) -> str:
    from h3_checkpoints import DiTShape, write_dit

    shape = DiTShape.full() if args.size == "full" else DiTShape.tiny()
    path = Path(args.workdir) / f"dit_{args.size}_{args.weights}.safetensors"
    if not path.exists():
        t0 = time.perf_counter()
        write_dit(path, shape, args.weights, seed=0,
                  device="cuda" if torch.cuda.is_available() else "cpu")
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return str(path)


def pack_model(patcher, args, chunking: bool):
    """The H3 Multi-GPU node's work on the model: plan, placement, guard, plan features."""
    from h3_multigpu.nodes.comfy_placement import place_model
    from h3_multigpu.nodes.devices import gpu_inventory
    from h3_multigpu.nodes.features import apply_feature, apply_plan
    from h3_multigpu.nodes.placement import placement_from_plan
    from h3_multigpu.nodes.planning import comfy_loader_inputs, make_plan

    devices = "auto" if torch.cuda.is_available() else "1x5090"
    plan = make_plan(pass2_width=args.width, pass2_height=args.height, pass1_width=args.width,
                     pass1_height=args.height, seconds=args.frames / 24.0, devices=devices,
                     lora_rank=0, **comfy_loader_inputs(devices, patcher))
    placement = placement_from_plan(plan, gpu_inventory())
    lines: dict[str, str] = {}
    if placement.root is not None:
        patcher, lines["placement"] = place_model(patcher, placement.root)
    patcher, features = apply_plan(patcher, plan, placement)
    lines.update(features)
    lines["plan"] = plan.report().splitlines()[:6]
    if chunking:
        from h3_multigpu.chunking import ChunkingConfig

        patcher = apply_feature(patcher, "chunking",
                                ChunkingConfig.from_strings("auto", "auto", "auto"))
        from h3_multigpu.nodes.status import feature_lines

        lines["chunking (forced)"] = feature_lines(patcher.model_options).get("chunking", "?")
    return patcher, lines


def memory_now() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    out = {"torch_peak_gib": torch.cuda.max_memory_allocated() / GIB,
           "torch_reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB,
           "device_used_gib": (total - free) / GIB}
    try:
        import comfy_aimdo.control

        out["aimdo_vram_gib"] = comfy_aimdo.control.get_total_vram_usage() / GIB
    except Exception as exc:  # the figure is optional; say why it is missing
        out["aimdo_vram_error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_variant(name, patcher, inputs, reps):
    from comfyui_h3 import run_like_sampler

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = run_like_sampler(patcher, inputs)  # warm-up: loads the weights ComfyUI's way
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = run_like_sampler(patcher, inputs)
        sync()
        times.append(time.perf_counter() - t0)
    result = {"first_s": first, "times_s": times, "best_s": min(times), **memory_now()}
    print(f"{name}: best {min(times):.3f} s (first {first:.2f} s) {memory_now()}", flush=True)
    return out, result


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    cuda = torch.cuda.is_available()
    if not cuda:
        comfy.cli_args.args.cpu = True
    from comfyui_h3 import (
        ComfyUIUnavailable,
        TinyH3Config,
        enable_dynamic_vram,
        import_comfyui,
        load_dit,
        make_inputs,
        unload_all,
    )

    # DynamicVRAM before anything imports ComfyUI (comfy-aimdo's modules read its library when
    # they are imported), with a capped card's missing memory as comfy-aimdo's headroom
    dynamic = False
    if cuda and args.dynamic != "off":
        try:
            enable_dynamic_vram(headroom_for_cap(args.cap_gib))
            dynamic = True
        except ComfyUIUnavailable as exc:
            if args.dynamic == "on":
                raise SystemExit(f"DynamicVRAM was asked for: {exc}") from exc
            print(f"DynamicVRAM off: {exc}", flush=True)
    import_comfyui()
    import comfy.model_management as mm

    if cuda and args.cap_gib:
        apply_cap(args.cap_gib)
    path = checkpoint(args)
    thw, audio_t = latent_sizes(args.width, args.height, args.frames)
    text_dim = 5120 if args.size == "full" else TinyH3Config().text_dim
    inputs = make_inputs(TinyH3Config(text_dim=text_dim), latent_thw=thw, audio_t=audio_t,
                         text_len=args.text_tokens, seed=1)
    dtype = torch.bfloat16
    report = {"argv": sys.argv, "comfyui": _comfyui_version(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
              "dynamic_vram": dynamic, "cap_gib": args.cap_gib, "weights": args.weights,
              "latent_thw": thw, "audio_t": audio_t, "text_tokens": args.text_tokens,
              "variants": {}}
    results = report["variants"]
    stock_out = None
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        t0 = time.perf_counter()
        base = load_dit(path, dtype=dtype)
        load_s = time.perf_counter() - t0
        lines = {}
        patcher = base
        if name.startswith("pack"):
            patcher, lines = pack_model(base, args, chunking=name == "pack+chunking")
        try:
            out, res = run_variant(name, patcher, inputs, args.reps)
        except torch.OutOfMemoryError as exc:
            res, out = {"error": f"out of memory: {str(exc).splitlines()[0]}"}, None
            print(f"{name}: OUT OF MEMORY", flush=True)
        res.update(load_s=load_s, patcher=type(base).__name__, dynamic=bool(base.is_dynamic()),
                   status=lines)
        if out is not None:
            if stock_out is None:
                stock_out = out
            res["bit_identical_to_first"] = all(torch.equal(a, b)
                                                for a, b in zip(out, stock_out, strict=True))
        results[name] = res
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))  # so far
        del patcher, base, out
        unload_all()
        gc.collect()
        mm.soft_empty_cache()
    if "stock" in results and "best_s" in results["stock"]:
        for name, res in results.items():
            if name != "stock" and "best_s" in res:
                res["vs_stock"] = res["best_s"] / results["stock"]["best_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"{'variant':16s} {'best s':>8s} {'vs stock':>9s} {'peak GiB':>9s} {'exact':>6s}")
    for name, res in results.items():
        print(f"{name:16s} {res.get('best_s', float('nan')):8.3f} "
              f"{res.get('vs_stock', 1.0):9.4f} {res.get('torch_peak_gib', 0.0):9.2f} "
              f"{str(res.get('bit_identical_to_first', '-')):>6s} {res.get('error', '')}")
    return 0


def _comfyui_version() -> str:
    try:
        import comfyui_version

        return comfyui_version.__version__
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
