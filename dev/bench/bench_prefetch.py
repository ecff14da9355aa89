"""Benchmark: DiT blocks streamed from host memory vs all resident, on one GPU.

    python dev/bench/bench_prefetch.py --out "$OUT"        # one H200, ~2-4 minutes
    python dev/bench/bench_prefetch.py --dry-run --out /tmp/prefetch   # tiny CPU twin, seconds

Part 1, per-block cost: the full-size twin (bf16, real block shapes) cut to `--blocks` blocks
(default 8: per-block cost is what matters, and it keeps the run short), at S = 15,399 /
35,305 / 68,706 tokens (864x480 124 f, 1312x736 124 f, 1312x736 243 f). Cases: all resident;
all streamed with look-ahead 2 and 3 (token refiner resident, so the numbers are per block);
K = 2 with the refiner streamed too (adds the step-boundary copy); a depth-1 baseline that
copies the next block on the compute stream (no side stream); pageable source through the
staging ring at S >= 35k. Per case: time per forward, ratio to resident, DiT-weight VRAM,
pinned host memory, peak allocated, and whether the output is bit-identical to resident.

Part 2, the 32 GB emulation: the full 50-block twin at S = 68,706 (PASS2 1312x736, 243 f).
All-resident bf16 weights alone exceed 32 GiB. The streamed model is prepared (streamed blocks
moved to pinned host memory), then `set_per_process_memory_fraction(32 GiB / total)` caps the
allocator and the forward runs under the cap.

Weights are filled with `normal_` on the device (the twin's CPU-seeded `randomize_` would take
minutes at this size); values do not matter for timing and stay finite. Each case catches and
reports its own exception; results are written after every case to `<out>/prefetch.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

GIB = 1 << 30


def _import_package() -> None:
    """Import the repo root as `h3_multigpu` when it is not installed (device machine copy)."""
    try:
        import h3_multigpu  # noqa: F401
        return
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        spec = importlib.util.spec_from_file_location(
            "h3_multigpu", root / "__init__.py", submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["h3_multigpu"] = module
        spec.loader.exec_module(module)


_import_package()

from h3_multigpu.common import geometry  # noqa: E402
from h3_multigpu.common.block_weights import module_bytes  # noqa: E402
from h3_multigpu.common.engine import CudaCopyEngine  # noqa: E402
from h3_multigpu.offload import (  # noqa: E402
    PrefetchConfig,
    apply_block_prefetch,
    get_block_prefetch,
    sizing,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the twin lives in tests/
from twin import TwinConfig, TwinPatcher, make_inputs  # noqa: E402
from twin.dit import MiniMaxH3Twin  # noqa: E402
from twin.rope import axis_inverse_frequencies  # noqa: E402

TEXT_TOKENS = 128
JOBS = [(864, 480, 124), (1312, 736, 124), (1312, 736, 243)]  # S = 15,399 / 35,305 / 68,706
TARGET_PCT = {15399: 3.0}  # otherwise 1 %
PAGEABLE_MIN_S = 35_000
PAGEABLE_TARGET_PCT = 3.0


# ---------------------------------------------------------------------------------- building
@torch.no_grad()
def build_twin(cfg: TwinConfig, device: str, dtype: torch.dtype, seed: int = 0) -> MiniMaxH3Twin:
    model = MiniMaxH3Twin(cfg, dtype=dtype, device=device)
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        std = p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02
        p.normal_(0.0, std * (0.1 if "adaln_proj" in name else 1.0))
    model.adaln_t_table.normal_()
    model.rope.inv_freq.copy_(axis_inverse_frequencies(cfg.rope_freqs_per_axis).to(device))
    return model.eval().requires_grad_(False)


def job_inputs(cfg: TwinConfig, job: dict, device: str, dtype: torch.dtype):
    return make_inputs(cfg, latent_t=job["t"], latent_h=job["h"], latent_w=job["w"],
                       audio_t=job["audio_t"], text_len=job["text"], dtype=dtype,
                       device=device, seed=1)


def full_jobs() -> list[dict]:
    jobs = []
    for width, height, frames in JOBS:
        _, _, t, h, w = geometry.latent_shape(width, height, frames)
        jobs.append({"S": geometry.video_audio_tokens(width, height, frames), "t": t, "h": h,
                     "w": w, "audio_t": geometry.audio_latent_steps(frames),
                     "text": TEXT_TOKENS, "canvas": f"{width}x{height}", "frames": frames})
    return jobs


def dry_jobs() -> list[dict]:
    jobs = []
    for t, h, w, audio_t in ((2, 4, 6, 5), (3, 8, 8, 10)):
        jobs.append({"S": t * (h // 2) * (w // 2) + 2 * audio_t, "t": t, "h": h, "w": w,
                     "audio_t": audio_t, "text": 16, "canvas": f"latent {h}x{w}", "frames": 0})
    return jobs


# ---------------------------------------------------------------------------------- measuring
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # timing: the forward's kernels must have finished


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peaks(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}


@torch.no_grad()
def time_forwards(patcher, inputs, steps: int, device: str,
                  min_seconds: float = 0.0) -> tuple[list[float], object]:
    """One warm-up forward, then at least `steps` timed ones and at least `min_seconds` of
    timing (at most 12 forwards); returns the times in seconds and the last output."""
    sync(device)
    start = time.perf_counter()
    out = patcher.apply_model(*inputs)
    sync(device)
    warm = time.perf_counter() - start
    steps = min(12, max(steps, math.ceil(min_seconds / max(warm, 1e-6))))
    reset_peak(device)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        out = patcher.apply_model(*inputs)
        sync(device)
        times.append(time.perf_counter() - start)
    return times, out


def block_vram_bytes(model: MiniMaxH3Twin, prefetch) -> int:
    """DiT block weights on the device: resident blocks (+ refiner if resident) and slots."""
    ids = [f"blocks.{i}" for i in range(len(model.blocks))]
    ids += [f"token_refiner.blocks.{j}" for j in range(len(model.token_refiner.blocks))]
    streamed = set() if prefetch is None else prefetch.streamed_ids
    resident = sum(module_bytes(_module(model, b)) for b in ids if b not in streamed)
    slots = 0 if prefetch is None or prefetch.streamer is None else \
        prefetch.streamer.stats()["slot_bytes"]
    return resident + slots


def _module(model, block_id: str):
    owner = model
    for part in block_id.split("."):
        owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
    return owner


# ---------------------------------------------------------------------------------- part 1
CASES = [
    {"case": "resident"},
    {"case": "streamed_k2", "lookahead": 2, "stream_refiner": False},
    {"case": "streamed_k3", "lookahead": 3, "stream_refiner": False},
    {"case": "streamed_k2_refiner", "lookahead": 2, "stream_refiner": True},
    {"case": "depth1_same_stream", "lookahead": 1, "stream_refiner": False,
     "same_stream": True},
    {"case": "pageable_k2", "lookahead": 2, "stream_refiner": False, "source": "pageable",
     "min_s": PAGEABLE_MIN_S},
    {"case": "resident_again"},  # clocks drift: ratios use the mean of both resident runs
]
RESIDENT_CASES = ("resident", "resident_again")


def make_patcher(base: TwinPatcher, case: dict, device: str):
    if case["case"] in RESIDENT_CASES:
        return base, None
    config = PrefetchConfig(resident_blocks=0, lookahead=case["lookahead"],
                            source=case.get("source", "auto"),
                            stream_refiner=case["stream_refiner"])
    patcher = apply_block_prefetch(base, config)
    prefetch = get_block_prefetch(patcher)
    prefetch.resolve()
    if case.get("same_stream") and device.startswith("cuda"):
        # baseline only: copies queued on the compute stream, so each one delays the block
        prefetch.streamer.engine = CudaCopyEngine(torch.device(device), side_stream=False)
    prefetch.prepare()
    return patcher, prefetch


def run_matrix(args, cfg, jobs, device, dtype, results: list, save) -> None:
    model = build_twin(cfg, device, dtype)
    base = TwinPatcher(model, load_device=device)
    reference: dict[int, object] = {}
    resident_ms: dict[int, float] = {}
    for case in CASES:
        patcher, prefetch = None, None
        try:
            patcher, prefetch = make_patcher(base, case, device)
        except Exception as error:  # report and keep going with the other cases
            results.append({"part": "matrix", **case, "error": repr(error),
                            "traceback": traceback.format_exc(limit=4)})
            save()
            continue
        for job in jobs:
            if job["S"] < case.get("min_s", 0):
                continue
            row = {"part": "matrix", **case, "S": job["S"], "blocks": cfg.blocks}
            try:
                inputs = job_inputs(cfg, job, device, dtype)
                times, out = time_forwards(patcher, inputs, args.steps, device,
                                           args.min_timed_s)
                ms = statistics.median(times) * 1e3
                row.update({"ms_per_forward": [t * 1e3 for t in times], "median_ms": ms,
                            **peaks(device),
                            "block_weight_vram_gib": block_vram_bytes(model, prefetch) / GIB})
                if prefetch is not None:
                    row.update({f"stream_{k}": v for k, v in prefetch.streamer.stats().items()})
                    row["pinned_host_gib"] = prefetch.streamer.stats()["pinned_bytes"] / GIB
                if case["case"] == "resident":
                    reference[job["S"]] = [t.clone() for t in out]
                    resident_ms[job["S"]] = ms
                elif case["case"] == "resident_again":
                    row["bit_identical"] = job["S"] in reference and all(
                        torch.equal(a, b) for a, b in zip(out, reference[job["S"]], strict=True))
                else:
                    row["bit_identical"] = job["S"] in reference and all(
                        torch.equal(a, b) for a, b in zip(out, reference[job["S"]], strict=True))
                    if job["S"] in resident_ms:
                        ratio = ms / resident_ms[job["S"]]
                        row["ratio_vs_resident"] = ratio
                        row["target_pct"] = (PAGEABLE_TARGET_PCT if case.get("source") ==
                                             "pageable" else TARGET_PCT.get(job["S"], 1.0))
                del inputs, out
            except Exception as error:
                row.update({"error": repr(error), "traceback": traceback.format_exc(limit=4)})
            results.append(row)
            save()
            print(_line(row), flush=True)
        try:
            if prefetch is not None:
                prefetch.close()  # weights back on the device for the next case
        except Exception as error:
            results.append({"part": "matrix", **case, "close_error": repr(error)})
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    del model, base, reference
    finalize_ratios(results)


def finalize_ratios(results: list[dict]) -> None:
    """Ratios against the mean of the two resident runs at the same S (first and last case)."""
    resident: dict[int, list[float]] = {}
    for row in results:
        if row.get("case") in RESIDENT_CASES and "median_ms" in row:
            resident.setdefault(row["S"], []).append(row["median_ms"])
    for row in results:
        runs = resident.get(row.get("S"))
        if not runs or "median_ms" not in row or row.get("part") != "matrix":
            continue
        row["resident_ms_mean"] = statistics.mean(runs)
        row["resident_drift_pct"] = (max(runs) / min(runs) - 1.0) * 100.0
        ratio = row["median_ms"] / row["resident_ms_mean"]
        row["ratio_vs_resident"] = ratio
        row["overhead_pct"] = (ratio - 1.0) * 100.0
        if "target_pct" in row:
            row["meets_target"] = row["overhead_pct"] <= row["target_pct"]


# ---------------------------------------------------------------------------------- part 2
def run_emulation(args, cfg, job, device, dtype, results: list, save, cap_bytes: int) -> None:
    row: dict = {"part": "emulation_32gb", "S": job["S"], "blocks": cfg.blocks,
                 "cap_gib": cap_bytes / GIB}
    model = None
    try:
        model = build_twin(cfg, device, dtype)
        base = TwinPatcher(model, load_device=device)
        inputs = job_inputs(cfg, job, device, dtype)
        all_blocks = block_vram_bytes(model, None)
        row["all_resident_block_weights_gib"] = all_blocks / GIB
        row["all_resident_fits_cap"] = all_blocks < cap_bytes
        if args.emulation_resident_reference:
            times, _ = time_forwards(base, inputs, 1, device)
            row["resident_uncapped_ms"] = times[0] * 1e3
        block = module_bytes(model.blocks[0])
        other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if not n.startswith(("blocks.", "token_refiner.blocks.")))
        budget = cap_bytes - args.activation_reserve_gib * GIB - other
        resident = sizing.resident_blocks_for_budget(budget, blocks=cfg.blocks,
                                                     block_bytes=block, lookahead=2)
        row["resident_blocks"] = resident
        patcher = apply_block_prefetch(base, PrefetchConfig(resident_blocks=resident,
                                                            lookahead=2))
        prefetch = get_block_prefetch(patcher)
        prefetch.prepare()  # the streamed blocks leave the device before the cap applies
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
        try:
            times, _ = time_forwards(patcher, inputs, args.emulation_steps, device)
        finally:
            if device.startswith("cuda"):
                torch.cuda.set_per_process_memory_fraction(1.0)
        ms = statistics.median(times) * 1e3
        row.update({"ms_per_forward": [t * 1e3 for t in times], "median_ms": ms, **peaks(device),
                    "block_weight_vram_gib": block_vram_bytes(model, prefetch) / GIB,
                    "pinned_host_gib": prefetch.streamer.stats()["pinned_bytes"] / GIB,
                    **{f"stream_{k}": v for k, v in prefetch.streamer.stats().items()}})
        if "resident_uncapped_ms" in row:
            row["ratio_vs_resident_uncapped"] = ms / row["resident_uncapped_ms"]
        prefetch.close()  # unpins the host copies before the model is dropped
    except Exception as error:
        row.update({"error": repr(error), "traceback": traceback.format_exc(limit=6)})
    results.append(row)
    save()
    print(_line(row), flush=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- output
def _line(row: dict) -> str:
    """One progress line (ratios here use the first resident run; the table uses the mean)."""
    if "error" in row:
        return f"{row.get('case', row['part']):<22} S={row.get('S', '-'):>7}  ERROR {row['error']}"

    def fmt(key, spec):
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    return (f"{row.get('case', row['part']):<22} S={row['S']:>7}  "
            f"{fmt('median_ms', '9.1f')} ms  x{fmt('ratio_vs_resident', '.4f')}  "
            f"+{fmt('overhead_pct', '.2f')}%  weights {fmt('block_weight_vram_gib', '.2f')} GiB  "
            f"pinned {fmt('pinned_host_gib', '.2f')} GiB  peak {fmt('peak_allocated_gib', '.2f')}"
            f" GiB  exact={row.get('bit_identical', '-')}")


def markdown_table(results: list[dict]) -> str:
    lines = ["| case | S | ms/forward | vs resident | block VRAM GiB | pinned GiB | peak GiB "
             "| exact | target |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        if "error" in row:
            lines.append(f"| {row.get('case', row['part'])} | {row.get('S', '-')} | error: "
                         f"{row['error'][:60]} | | | | | | |")
            continue
        if "median_ms" not in row:
            continue
        ratio = row.get("ratio_vs_resident", row.get("ratio_vs_resident_uncapped"))
        target = row.get("target_pct")
        lines.append(
            f"| {row.get('case', row['part'])} | {row['S']:,} | {row['median_ms']:.1f} | "
            f"{'-' if ratio is None else f'{ratio:.4f}'} | "
            f"{row.get('block_weight_vram_gib', 0):.2f} | {row.get('pinned_host_gib') or 0:.2f} | "
            f"{row.get('peak_allocated_gib') or 0:.2f} | {row.get('bit_identical', '-')} | "
            f"{'-' if target is None else ('ok' if row['meets_target'] else 'MISS')} "
            f"{'' if target is None else f'(<= {target:g}%)'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU twin, a few seconds")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--blocks", type=int, default=8, help="blocks in the part-1 twin")
    parser.add_argument("--steps", type=int, default=2, help="timed forwards per case")
    parser.add_argument("--min-timed-s", type=float, default=1.5,
                        help="part 1: time at least this long per case (short forwards)")
    parser.add_argument("--emulation-steps", type=int, default=1)
    parser.add_argument("--no-emulation-resident-reference", dest="emulation_resident_reference",
                        action="store_false", help="skip the uncapped all-resident forward")
    parser.add_argument("--activation-reserve-gib", type=float, default=12.0,
                        help="32 GB emulation: VRAM kept for activations at S=68,706")
    parser.add_argument("--skip-emulation", action="store_true")
    parser.add_argument("--only-emulation", action="store_true",
                        help="run only the 32 GB emulation (writes prefetch_emulation.json)")
    args = parser.parse_args(argv)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.dry_run:
        device, dtype = "cpu", torch.float32
        cfg = TwinConfig.tiny(blocks=4, refiner_blocks=2)
        jobs = dry_jobs()
        global PAGEABLE_MIN_S
        PAGEABLE_MIN_S = 0
        for case in CASES:
            case.pop("min_s", None)
        emu_cfg, emu_job, cap = TwinConfig.tiny(blocks=6, refiner_blocks=2), jobs[-1], 1 << 20
        args.activation_reserve_gib = 0.0
    else:
        device, dtype = "cuda", torch.bfloat16
        cfg = TwinConfig.full(blocks=args.blocks)
        jobs = full_jobs()
        emu_cfg, emu_job, cap = TwinConfig.full(), jobs[-1], 32 * GIB

    header = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "blocks_timed": cfg.blocks, "steps": args.steps,
              "text_tokens": jobs[0]["text"]}
    results: list[dict] = []

    def save() -> None:
        payload = {"header": header, "results": results,
                   "elapsed_s": time.perf_counter() - started}
        name = "prefetch_emulation.json" if args.only_emulation else "prefetch.json"
        (out_dir / name).write_text(json.dumps(payload, indent=1, default=str))

    if not args.only_emulation:
        run_matrix(args, cfg, jobs, device, dtype, results, save)
    if not args.skip_emulation:
        run_emulation(args, emu_cfg, emu_job, device, dtype, results, save, cap)
    save()
    table = markdown_table(results)
    if not args.only_emulation:
        (out_dir / "prefetch.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out_dir / 'prefetch.json'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
