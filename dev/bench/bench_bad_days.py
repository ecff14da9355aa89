"""Bad days on one GPU: out of memory at a too-long clip, a cancel mid-step, ten runs in a row.

    python dev/bench/bench_bad_days.py --out $OUT/bad_days.json                 # H200, 32 GiB card
    python dev/bench/bench_bad_days.py --tiny --out /tmp/bad_days_tiny.json     # CPU dry run

ComfyUI comes from $COMFYUI_PATH (DynamicVRAM on as main.py does, unless --dynamic off). The
full-size INT8 ConvRot DiT (tests/h3_checkpoints.py DiTShape.full, random weights) is loaded
through ComfyUI's loader as dev/bench/bench_release_step.py does, on a card emulated at --cap-gib
(torch's allocator capped with set_per_process_memory_fraction, ComfyUI and comfy-aimdo
reserving the rest). The pack is what the H3 Multi-GPU node applies for the short clip's plan.
Phases, all in one process, one model call per sampler run (sigmas 0.9 -> 0):
1. reference: the stock patcher at the two short sizes (PASS1-like 864x480 and PASS2-like
   1312x736, --frames);
2. oom: the packed model at --oom-frames (too long for the card): the pack's OOM message, what
   it freed, allocated/reserved after. A watchdog cancels after --watchdog-s should it fit;
3. after: the short PASS2-like clip again in the same process, compared bit for bit;
4. cancel: ComfyUI's interrupt set mid-call (as the middle DiT block starts): seconds from the
   cancel to the return, the pack's threads, then a run compared bit for bit;
5. ten runs alternating the two short sizes: memory_allocated, max_memory_reserved, RSS and the
   pack's live objects after each, each output compared with its reference.
--tiny: the tiny DiT on the CPU; the OOM is injected (torch.OutOfMemoryError from the first
block above --inject-oom-tokens rows), the rest runs as on the GPU. JSON to --out after each
phase; a short table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
sys.path.insert(0, str(HERE))
GIB = 1024 ** 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny DiT on the CPU (dry run)")
    p.add_argument("--cap-gib", type=float, default=32.0)
    p.add_argument("--frames", type=int, default=124, help="the short clips' frames")
    p.add_argument("--oom-frames", type=int, default=1212,
                   help="the too-long clip at 1312x736 (1205 f = 50 s, S ~ 332k)")
    p.add_argument("--watchdog-s", type=float, default=60.0)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--dynamic", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--inject-oom-tokens", type=int, default=None,
                   help="raise OOM in a block with more rows (default: only with --tiny)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "h3_bench"))
    args = p.parse_args(argv)
    args.size, args.weights, args.text_tokens = ("tiny" if args.tiny else "full",
                                                 "int8_convrot", 16 if args.tiny else 256)
    if args.tiny:
        args.frames, args.oom_frames = 5, 22
        if args.inject_oom_tokens is None:
            args.inject_oom_tokens = 60  # short clips: ~40 rows, the long one ~130
    return args


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def memory(extra: dict | None = None) -> dict:
    from h3_multigpu.guard.oom import pack_memory

    held = pack_memory()
    out = {"rss_gib": rss_bytes() / GIB, "pack_device_gib": held.device_bytes / GIB,
           "pack_host_buffers": held.host_buffers, "pack_pinned_gib": held.pinned_bytes / GIB,
           "pack_workspaces": held.workspaces, "pack_threads": list(held.threads)}
    if torch.cuda.is_available():
        out.update(allocated_gib=torch.cuda.memory_allocated() / GIB,
                   max_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                   reserved_gib=torch.cuda.memory_reserved() / GIB)
    return {**out, **(extra or {})}


class Sizes:
    def __init__(self, args):
        self.args = args

    def inputs(self, width: int, height: int, frames: int, seed: int):
        import bench_release_step as brs
        from comfyui_h3 import TinyH3Config, make_inputs

        thw, audio_t = brs.latent_sizes(width, height, frames)
        text_dim = TinyH3Config().text_dim if self.args.tiny else 5120
        return make_inputs(TinyH3Config(text_dim=text_dim), latent_thw=thw, audio_t=audio_t,
                           text_len=self.args.text_tokens, seed=seed)


def timed(patcher, inputs):
    from comfyui_h3 import run_like_sampler

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    out = run_like_sampler(patcher, inputs)
    sync()
    return out, time.perf_counter() - t0


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def inject_oom(patcher, rows: int):
    """Raise torch's OutOfMemoryError from the first DiT block when its input has more rows."""
    def hook(module, args, kwargs):
        x = args[0] if args else kwargs.get("x")
        if x is not None and x.shape[-2 if x.ndim > 2 else 0] > rows:
            raise torch.OutOfMemoryError(
                f"CPU out of memory (injected). Tried to allocate {x.numel() * 4 / GIB:.2f} GiB.")
    return patcher.model.diffusion_model.blocks[0].register_forward_pre_hook(hook,
                                                                            with_kwargs=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        comfy.cli_args.args.cpu = True
    import bench_release_step as brs
    from comfyui_h3 import ComfyUIUnavailable, enable_dynamic_vram, import_comfyui, load_dit

    dynamic = False
    if cuda and args.dynamic != "off":
        try:
            enable_dynamic_vram(brs.headroom_for_cap(args.cap_gib))
            dynamic = True
        except ComfyUIUnavailable as exc:
            if args.dynamic == "on":
                raise SystemExit(f"DynamicVRAM was asked for: {exc}") from exc
    import_comfyui()
    import comfy.model_management as mm

    from h3_multigpu.guard.device import guard_diffusion_model, has_device_guard
    from h3_multigpu.guard.oom import PackOutOfMemoryError

    if cuda:
        brs.apply_cap(args.cap_gib)
    report: dict = {"argv": sys.argv, "comfyui": brs._comfyui_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "dynamic_vram": dynamic, "cap_gib": args.cap_gib if cuda else None}
    out_path = Path(args.out)

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1, default=str))

    sizes = Sizes(args)
    small = (64, 32) if args.tiny else (864, 480)
    large = (64, 64) if args.tiny else (1312, 736)
    short = {"pass1": sizes.inputs(*small, args.frames, seed=1),
             "pass2": sizes.inputs(*large, args.frames, seed=2)}
    started = time.perf_counter()
    t0 = time.perf_counter()
    base = load_dit(brs.checkpoint(args), dtype=torch.bfloat16)
    report["load_s"] = time.perf_counter() - t0
    # 1. references: the stock patcher
    reference, call_s = {}, {}
    for name, inputs in short.items():
        timed(base, inputs)  # warm-up (loads the weights ComfyUI's way)
        reference[name], call_s[name] = timed(base, inputs)
    report["reference"] = {"call_s": call_s, **memory()}
    save()
    plan_args = argparse.Namespace(width=large[0], height=large[1], frames=args.frames)
    packed, lines = brs.pack_model(base, plan_args, chunking=False)
    report["pack_status"] = lines
    if not has_device_guard(packed):  # no GPU placed (the CPU dry run): the node's guard
        packed = guard_diffusion_model(packed.clone())
    hook = inject_oom(packed, args.inject_oom_tokens) if args.inject_oom_tokens else None

    # 2. out of memory at a too-long clip
    long = sizes.inputs(*large, args.oom_frames, seed=3)
    watchdog = threading.Timer(args.watchdog_s, mm.interrupt_current_processing, (True,))
    watchdog.start()
    t0 = time.perf_counter()
    outcome, message = "completed (no OOM: raise --oom-frames)", ""
    try:
        timed(packed, long)
    except PackOutOfMemoryError as exc:
        outcome, message = "out of memory (the pack's message)", str(exc)
    except torch.OutOfMemoryError as exc:
        outcome, message = "out of memory (torch's message only)", str(exc)
    except mm.InterruptProcessingException:
        outcome = f"cancelled by the {args.watchdog_s:.0f} s watchdog (no OOM)"
    finally:
        watchdog.cancel()
        mm.interrupt_current_processing(False)
    oom_s = time.perf_counter() - t0
    report["oom"] = {"frames": args.oom_frames, "outcome": outcome, "seconds": oom_s,
                     "message": message.split("\n"), **memory()}
    with torch.inference_mode():  # ComfyUI's executor runs under it (INT8 weights need it)
        mm.unload_all_models()  # what ComfyUI's execution.py does after an OOM
    mm.soft_empty_cache()
    report["oom"]["after_unload"] = memory()
    save()
    print(f"oom: {outcome} in {oom_s:.1f} s", flush=True)

    # 3. the short clip again, same process
    out, seconds = timed(packed, short["pass2"])
    report["after_oom"] = {"call_s": seconds, "bit_identical": same(out, reference["pass2"]),
                           **memory()}
    save()

    # 4. a cancel mid-call: set as the middle DiT block starts (the user's click, at a known
    # point of the step), timed until the sampler call returns
    blocks = packed.model.diffusion_model.blocks
    cancel_at: list[float] = []

    def cancel(module, args, kwargs):
        if not cancel_at:
            cancel_at.append(time.perf_counter())
            mm.interrupt_current_processing(True)

    handle = blocks[len(blocks) // 2].register_forward_pre_hook(cancel, with_kwargs=True)
    cancelled = False
    try:
        timed(packed, short["pass2"])
    except mm.InterruptProcessingException:
        cancelled = True
    finally:
        returned = time.perf_counter()
        handle.remove()
        mm.interrupt_current_processing(False)
    threads_left = [t.name for t in threading.enumerate() if t.name.startswith("h3-decode")]
    after_cancel = memory()
    out, seconds = timed(packed, short["pass2"])
    report["cancel"] = {"cancelled": cancelled, "at_block": len(blocks) // 2,
                        "decode_threads_left": threads_left,
                        "return_after_cancel_s": returned - cancel_at[0] if cancel_at else None,
                        "after": after_cancel, "next_call_s": seconds,
                        "next_bit_identical": same(out, reference["pass2"])}
    save()

    # 5. ten runs in a row, two sizes alternating
    rows = []
    for run in range(args.runs):
        name = ("pass1", "pass2")[run % 2]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out, seconds = timed(packed, short[name])
        exact = same(out, reference[name])
        del out
        gc.collect()
        rows.append({"run": run + 1, "size": name, "call_s": seconds, "bit_identical": exact,
                     **memory()})
    report["runs"] = rows
    if hook is not None:
        hook.remove()
    report["total_s"] = time.perf_counter() - started
    save()
    print(f"{'phase':12s} {'s':>7s} {'exact':>6s} {'alloc GiB':>9s} {'maxres GiB':>10s} "
          f"{'RSS GiB':>8s} {'pack dev GiB':>12s}")
    table = [("reference", call_s["pass2"], "-", report["reference"]),
             ("oom", oom_s, outcome.split(" (")[0], report["oom"]["after_unload"]),
             ("after_oom", report["after_oom"]["call_s"], report["after_oom"]["bit_identical"],
              report["after_oom"]),
             ("cancel", report["cancel"]["return_after_cancel_s"] or 0.0,
              report["cancel"]["next_bit_identical"], after_cancel),
             *((f"run {r['run']} {r['size']}", r["call_s"], r["bit_identical"], r)
               for r in rows)]
    for name, seconds, exact, mem in table:
        print(f"{name:12s} {seconds:7.2f} {str(exact):>6s} {mem.get('allocated_gib', 0):9.2f} "
              f"{mem.get('max_reserved_gib', 0):10.2f} {mem['rss_gib']:8.2f} "
              f"{mem['pack_device_gib']:12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
