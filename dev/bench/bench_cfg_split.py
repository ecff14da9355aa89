"""CFG above 1 on two or four GPUs: ComfyUI's MultiGPU CFG Split against the pack's modes.

One sampling step (CFGGuider at CFG 4: cond and uncond) of ComfyUI's real H3 DiT at full width
with random weights (tests/h3_checkpoints.py, loaded by ComfyUI's own loader), `--blocks` of its
50 blocks, at the default job's PASS1 and PASS2 sizes (864x480 and 1312x736, 5 s), through
ComfyUI's own sampler path:
- `one_gpu`: the root GPU alone (ComfyUI runs the two calls, batched when memory allows);
- `cfg_split`: core's MultiGPU CFG Split (its node's execute, max_gpus 2): one call a GPU;
- `sequence`: the pack's sequence parallel over the GPUs, both calls;
- `cfg_sequence` (`--gpus 4`): the 2x2, the pack's sequence mode on the three helpers and then
  core's CFG Split (max_gpus 2): one sequence pair a cond.
Each mode's output is compared with `one_gpu` (bit for bit and the largest difference), the 2x2's
also with `cfg_split` (its yardstick: core's CFG-split output), and the planner's prediction for
this machine (`planner.plan_job`, `--cfg 4`) is scaled to the blocks run (its per-step time over
50 blocks), so the time model's CFG modes are checked against real ones.

Needs two GPUs, four for `--gpus 4` (the issue holding the multi-GPU runs); `--tiny` checks the
script on a CPU with stand-in devices (cpu, cpu:0, ...) and the tiny DiT:

    PYTHONPATH=<folder holding h3_multigpu> COMFYUI_PATH=/path/to/ComfyUI \\
        python dev/bench/bench_cfg_split.py --out $OUT/cfg_split.json
    PYTHONPATH=... COMFYUI_PATH=... python dev/bench/bench_cfg_split.py --gpus 4 \\
        --out $OUT/cfg_split_2x2.json
    COMFYUI_PATH=... python dev/bench/bench_cfg_split.py --tiny [--gpus 4] --out /tmp/cfg.json

About 3-6 minutes on two H100/H200s at the default 8 blocks (loading included). JSON to --out,
short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

MODES = ("one_gpu", "cfg_split", "sequence", "cfg_sequence")
CFG = 4.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny DiT, stand-in devices")
    p.add_argument("--gpus", type=int, choices=(2, 4), default=2,
                   help="2: one_gpu, cfg_split, sequence; 4: also the 2x2 (cfg_sequence)")
    p.add_argument("--formats", default="int8_convrot,bf16")
    p.add_argument("--blocks", type=int, default=8, help="DiT blocks of the 50 (default 8)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _devices(tiny: bool, count: int) -> list[torch.device]:
    """The planner's root first (GPU1), then its helpers (GPU0 first: CFG Split's copy)."""
    if tiny:
        return [torch.device("cpu"), *(torch.device("cpu", i) for i in range(count - 1))]
    if torch.cuda.device_count() < count:
        raise SystemExit(f"bench_cfg_split --gpus {count} needs {count} GPUs (or --tiny on a "
                         "CPU)")
    return [torch.device("cuda", i) for i in (1, 0, *range(2, count))]


def _modes(count: int) -> tuple[str, ...]:
    return MODES if count == 4 else MODES[:3]


def _stand_in_devices(devices: list[torch.device]) -> None:
    """ComfyUI's device list as `devices` (CFG Split reads it for its extra GPUs)."""
    import comfy.model_management as mm

    mm.get_all_torch_devices = lambda exclude_current=False: list(devices)


def _cases(tiny: bool) -> dict[str, tuple[int, int, int, int]]:
    """Per pass (latent t, h, w, audio t), the default job's sizes (tiny: a few rows)."""
    from h3_multigpu.common import geometry

    if tiny:
        return {"pass1": (3, 4, 6, 5), "pass2": (3, 6, 8, 5)}
    out = {}
    for name, (w, h) in (("pass1", (864, 480)), ("pass2", (1312, 736))):
        p = geometry.PassGeometry.from_seconds(w, h, 5.0)
        _, _, t, lh, lw = p.latent
        out[name] = (t, lh, lw, p.audio_latent[-1])
    return out


def _load(fmt: str, args, root: torch.device, workdir: str):
    from comfyui_h3 import load_dit
    from h3_checkpoints import DiTShape, write_dit

    shape = DiTShape.tiny(heads=4) if args.tiny else replace(DiTShape.full(), blocks=args.blocks)
    path = os.path.join(workdir, f"dit_{fmt}_{shape.blocks}_{'tiny' if args.tiny else 'full'}"
                                 ".safetensors")
    if not os.path.exists(path):
        write_dit(path, shape, fmt, seed=0)
    dtype = torch.float32 if args.tiny and fmt != "int8_convrot" else torch.bfloat16
    return load_dit(path, dtype=dtype, load_device=root), shape


def _model(mode: str, patcher, devices):
    from test_cfg_split_comfyui import cfg_split

    from h3_multigpu.nodes.features import apply_from_strings

    if mode == "one_gpu":
        return patcher.clone()
    if mode == "cfg_split":
        return cfg_split(patcher, 2)
    names = ",".join(str(d) if d.type == "cpu" else f"gpu:{d.index}" for d in devices[1:])
    sequence = apply_from_strings(patcher, "sequence", parallel="sequence", helpers=names)
    return cfg_split(sequence, 2) if mode == "cfg_sequence" else sequence


def _engaged(mode: str, model, split_steps: list[int]) -> dict:
    """What ran: CFG Split's multi-GPU steps, the sequence mode's steps per mode."""
    if mode == "cfg_split":
        return {"cfg_split_steps": split_steps[0]}
    if mode in ("sequence", "cfg_sequence"):
        from h3_multigpu.sequence import get_sequence_parallel

        found = get_sequence_parallel(model)
        if found is None:
            return {"sequence_steps": None}
        steps = found.cfg.steps if mode == "cfg_sequence" else found.steps
        return {"sequence_steps": dict(steps),
                **({"cfg_split_steps": split_steps[0]} if mode == "cfg_sequence" else {})}
    return {}


def _count_split_steps() -> list[int]:
    """A counter of core's multi-GPU cond batches (`samplers._calc_cond_batch_multigpu`)."""
    import comfy.samplers as samplers

    count = [0]
    original = samplers._calc_cond_batch_multigpu

    def counted(*a, **k):
        count[0] += 1
        return original(*a, **k)

    samplers._calc_cond_batch_multigpu = counted
    return count


def _timed(fn, iters: int, warmup: int) -> tuple[list[float], object]:
    times, out = [], None
    for i in range(warmup + iters):
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, out


def _predicted(args, blocks: int) -> dict:
    """The planner's per-step times on this machine at CFG 4, scaled to the blocks run."""
    if args.tiny:
        return {}
    from h3_multigpu.planner import PlanRequest, detect_hardware, plan_job

    plan = plan_job(PlanRequest(profile=detect_hardware(), seconds=5.0, pass1_cfg=CFG,
                                pass2_cfg=CFG), suggest=False)
    return {name: {mode: s * blocks / 50 for mode, s in (p.options_s or {}).items()}
            for name, p in plan.parallel.passes.items()}


def bench(fmt: str, args, devices, workdir: str) -> dict:
    from comfyui_h3 import make_inputs, run_like_sampler, unload_all

    patcher, shape = _load(fmt, args, devices[0], workdir)
    split_steps = _count_split_steps()
    result: dict = {"format": fmt, "blocks": shape.blocks, "passes": {}}
    for name, (t, h, w, audio_t) in _cases(args.tiny).items():
        inputs = make_inputs(types.SimpleNamespace(text_dim=shape.text_dim),
                             latent_thw=(t, h, w), audio_t=audio_t, text_len=256 // 16
                             if args.tiny else 256, seed=1)
        gen = torch.Generator().manual_seed(7)
        negative = [[torch.randn(inputs.positive[0][0].shape, generator=gen), {}]]
        row: dict = {"latent_thw": [t, h, w]}
        reference = core_split = None
        for mode in _modes(len(devices)):
            unload_all()
            model = _model(mode, patcher, devices)
            split_steps[0] = 0

            def step(m=model, i=inputs, n=negative):
                return run_like_sampler(m, i, negative=n, cfg=CFG)

            try:
                times, out = _timed(step, args.iters, args.warmup)
            except Exception as exc:  # a mode that cannot run here is recorded, not fatal
                row[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            entry = {"step_s": sorted(times)[len(times) // 2], "times_s": times,
                     **_engaged(mode, model, split_steps)}
            if reference is None:
                reference = out
            else:
                pairs = list(zip(out, reference, strict=True))
                entry["bit_identical"] = all(torch.equal(a, b) for a, b in pairs)
                entry["max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                            for a, b in pairs)
            if mode == "cfg_split":
                core_split = out
            elif mode == "cfg_sequence" and core_split is not None:
                entry["bit_identical_vs_cfg_split"] = all(
                    torch.equal(a, b) for a, b in zip(out, core_split, strict=True))
            row[mode] = entry
        result["passes"][name] = row
    unload_all()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    from comfyui_h3 import import_comfyui

    import_comfyui()
    devices = _devices(args.tiny, args.gpus)
    _stand_in_devices(devices) if args.tiny else None
    torch.set_num_threads(2) if args.tiny else None
    report = {"devices": [str(d) for d in devices], "cfg": CFG,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "torch": torch.__version__, "results": []}
    with tempfile.TemporaryDirectory() as workdir:
        for fmt in args.formats.split(","):
            if args.tiny and fmt == "int8_convrot":
                continue  # comfy-kitchen's INT8 GEMMs need a GPU
            report["results"].append(bench(fmt.strip(), args, devices, workdir))
    report["predicted_s"] = _predicted(args, args.blocks)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'format':<14}{'pass':<7}{'mode':<13}{'step s':>9}{'vs one':>8}{'predicted':>11}"
          f"  exact  ran  (cfg_sequence: exact vs cfg_split)")
    for res in report["results"]:
        for name, row in res["passes"].items():
            base = row.get("one_gpu", {}).get("step_s")
            for mode in _modes(len(devices)):
                entry = row.get(mode, {})
                if "error" in entry:
                    print(f"{res['format']:<14}{name:<7}{mode:<13}  {entry['error'][:60]}")
                    continue
                key = {"one_gpu": "off"}.get(mode, "cfg" if mode == "cfg_split" else mode)
                pred = report["predicted_s"].get(name, {}).get(key)
                ratio = base / entry["step_s"] if base else float("nan")
                exact = {True: "bit", False: f"{entry.get('max_abs_diff', 0):.1e}"}.get(
                    entry.get("bit_identical"), "ref")
                if "bit_identical_vs_cfg_split" in entry:
                    exact = "bit" if entry["bit_identical_vs_cfg_split"] else "DIFF"
                ran = " ".join(str(entry[k]) for k in ("cfg_split_steps", "sequence_steps")
                               if k in entry)
                print(f"{res['format']:<14}{name:<7}{mode:<13}{entry['step_s']:>9.3f}"
                      f"{ratio:>8.2f}{pred if pred is not None else float('nan'):>11.3f}"
                      f"  {exact:<5}  {ran}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
