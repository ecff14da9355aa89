"""Sequence-parallel benchmark: full 50-block denoising steps, one GPU vs Dual-Sage vs sequence.

Run on 2x H200 (root cuda:1 as in production, helper cuda:0), ~4-5 minutes for every row:
    python dev/bench/bench_sequence_parallel.py --out $OUT/sequence_parallel.json
Pick rows (most important first) with --rows, e.g. --rows pass2_69k,relay_69k:
    pass2_69k   PASS2 1312x736 243 f (S = 68,706): one GPU, Dual-Sage, sequence (peer)
    relay_69k   the same step, sequence through the pinned host relay (forced)
    emu32_69k   two emulated 32 GB cards (per-process memory fraction): root streams blocks
                from pinned memory (prefetcher), the helper streams from the same arena;
                one GPU (streamed) vs sequence; per-GPU peaks vs the planner's model
    pass2_35k   PASS2 1312x736 124 f (S = 35,305): one GPU, Dual-Sage, sequence
    pass1_30k   PASS1 864x480 243 f (S = 29,970): one GPU, Dual-Sage, sequence
    emu32_362f  362 frames at 1312x736 (S = 102,107) on the emulated 32 GB cards, no chunking:
                sequence only (one GPU does not fit), checked against the unconstrained one-GPU
                step (skip that 35 s check with --no-verify-362)
The emulated rows need PyTorch's expandable segments (the default caching allocator stranded
3.7 GiB under the cap): the bench sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True itself,
before torch starts, when --rows includes an emulated row and the variable is unset. Their
one-GPU reference runs once (only its output is compared); they print whole-GPU peaks next to
the model's. emu32_69k,emu32_362f --no-verify-362 take about 2 minutes.
Every ratio is against the one-GPU step of the same model, inputs and attention function (SDPA)
in the same process, and every split step is compared with it bit for bit. Tokens are video +
audio (the issue's S) plus --text-len text tokens. `--dry-run` runs every row on the CPU with
a tiny twin and fake devices (checks the code paths, not the speed). JSON to --out, short table
last.
"""

from __future__ import annotations

import os
import sys

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def _emulated_rows_requested(argv: list[str]) -> bool:
    """True unless --rows names rows that are all unconstrained (the default runs every row)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--rows=") else \
            (argv[i + 1] if arg == "--rows" and i + 1 < len(argv) else None)
        if value is not None:
            return "emu32" in value
    return True


if __name__ == "__main__" and ALLOC_CONF not in os.environ and \
        _emulated_rows_requested(sys.argv[1:]):
    # before torch reads it: under a 32 GiB cap the default caching allocator stranded 3.7 GiB
    # between streamed blocks and [S, F] activations (OOM asking 1.84 GiB at 27.3 allocated);
    # expandable segments grow one mapping per stream instead of splitting fixed segments
    os.environ[ALLOC_CONF] = "expandable_segments:True"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from h3_multigpu.chunking import sizing as block_sizing  # noqa: E402
from h3_multigpu.common import geometry  # noqa: E402
from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage  # noqa: E402
from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch, get_block_prefetch  # noqa: E402
from h3_multigpu.offload import sizing as offload_sizing  # noqa: E402
from h3_multigpu.sequence import (  # noqa: E402
    SequenceParallelConfig,
    apply_sequence_parallel,
    get_sequence_parallel,
)
from h3_multigpu.sequence import sizing as sequence_sizing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the twin lives in tests/
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin  # noqa: E402

GIB = 1 << 30
EMULATED_BYTES = 32 * GIB
# kept free under the emulated cap beside the modelled peak: cuBLAS workspaces, the
# allocator's rounding and what expandable segments still strand (the default allocator
# stranded 3.7 GiB: it needs expandable segments, see ALLOC_CONF above)
EMULATION_MARGIN_BYTES = 3 * GIB
LOOKAHEAD = 2
ROWS = ("pass2_69k", "relay_69k", "emu32_69k", "pass2_35k", "pass1_30k", "emu32_362f")
JOBS = {  # row -> (width, height, frames)
    "pass2_69k": (1312, 736, 243), "relay_69k": (1312, 736, 243), "emu32_69k": (1312, 736, 243),
    "pass2_35k": (1312, 736, 124), "pass1_30k": (864, 480, 243), "emu32_362f": (1312, 736, 362),
}


def sync(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class Bench:
    def __init__(self, args, root: torch.device, helper: torch.device):
        self.args, self.root, self.helper = args, root, helper
        self.devices = (root, helper)
        if args.dry_run:
            self.cfg = TwinConfig.tiny(blocks=3)
            self.dtype = torch.float32
        else:
            self.cfg = TwinConfig.full(blocks=args.blocks)
            self.dtype = torch.bfloat16
        # weights drawn on the GPU: seconds instead of minutes for 19 B parameters
        self.model = make_twin(self.cfg, dtype=self.dtype, device=root,
                               init_on_device=root.type == "cuda")
        self.small = make_inputs(self.cfg, dtype=self.dtype, device=root, latent_t=2,
                                 latent_h=8, latent_w=8, audio_t=4, text_len=16)
        self.references: dict[str, tuple[float, list[torch.Tensor]]] = {}

    # ------------------------------------------------------------------ inputs, timing
    def inputs(self, row: str):
        width, height, frames = JOBS[row]
        if self.args.dry_run:  # tiny shapes, same structure: ~100-200 tokens
            lat_t, lat_h, lat_w, audio_t = (5 if frames > 200 else 3), 8, 10, 12
            text = 16
        else:
            _, _, lat_t, lat_h, lat_w = geometry.latent_shape(width, height, frames)
            audio_t = geometry.audio_latent_steps(frames)
            text = self.args.text_len
        inputs = make_inputs(self.cfg, dtype=self.dtype, device=self.root, latent_t=lat_t,
                             latent_h=lat_h, latent_w=lat_w, audio_t=audio_t, text_len=text)
        tokens = lat_t * (lat_h // 2) * (lat_w // 2) + 2 * audio_t
        return inputs, tokens, tokens + text

    def step(self, patcher, inputs, reps: int) -> tuple[float, list[torch.Tensor], dict]:
        """Best wall ms of `reps` steps after a small warm-up; per-GPU peaks of the last.

        The best, not the median: a split mode's first full-size step also builds the helper's
        weights (replica copy or host copies) and its links, which later steps reuse.
        """
        with self._root_current():
            patcher.apply_model(*self.small)
            times, out, peaks = [], None, {}
            for rep in range(reps):
                sync(*self.devices)
                base = {}
                if rep == reps - 1:
                    for d in self.devices:
                        if d.type == "cuda":
                            base[d] = torch.cuda.memory_allocated(d)
                            torch.cuda.reset_peak_memory_stats(d)
                start = time.perf_counter()
                out = patcher.apply_model(*inputs)
                sync(*self.devices)
                times.append((time.perf_counter() - start) * 1e3)
            for d, allocated in base.items():
                peak = torch.cuda.max_memory_allocated(d)
                peaks[str(d)] = dict(peak_GiB=round(peak / GIB, 2),
                                     before_GiB=round(allocated / GIB, 2),
                                     activations_GiB=round((peak - allocated) / GIB, 2))
        self.last_times = [round(t, 1) for t in times]
        return min(times), out, peaks

    def _root_current(self):
        return torch.cuda.device(self.root) if self.root.type == "cuda" else \
            contextlib.nullcontext()

    def reference(self, row: str, inputs, reps: int | None = None
                  ) -> tuple[float, list[torch.Tensor]]:
        """The one-GPU step of this job (timed once per job, reused by later rows).

        reps: 1 where only its output is used (the emulated rows time their own one-GPU step).
        """
        key = str(JOBS[row])
        if key not in self.references:
            plain = TwinPatcher(self.model, load_device=self.root)
            ms, out, _ = self.step(plain, inputs, reps or self.args.reps)
            self.references[key] = (ms, out)
        return self.references[key]

    def sequence(self, base, **kwargs):
        helpers = ("cpu",) if self.root.type == "cpu" else (str(self.helper),)
        return apply_sequence_parallel(base, SequenceParallelConfig(
            parallel="sequence", helpers=helpers, **kwargs))

    # ------------------------------------------------------------------ rows
    def run_plain_row(self, row: str) -> dict:
        """One GPU, Dual-Sage, sequence (peer), or sequence over the host relay only."""
        inputs, tokens, total = self.inputs(row)
        relay = row.startswith("relay")
        result = dict(row=row, S=tokens, S_with_text=total)
        result["single_ms"], single = self.reference(row, inputs)
        base = TwinPatcher(self.model, load_device=self.root)
        if not relay and not self.args.skip_dual_sage:
            helpers = ("cpu",) if self.root.type == "cpu" else (str(self.helper),)
            dual = apply_dual_sage(base, DualSageConfig(helpers=helpers))
            ms, out, _ = self.step(dual, inputs, self.args.reps)
            result.update(dual_sage_ms=round(ms, 1),
                          dual_sage_speedup=round(result["single_ms"] / ms, 3),
                          dual_sage_exact=same(out, single))
            del dual, out
        transport = "host" if relay else self.args.transport
        for k, chunk in enumerate(self.args.chunk_heads or [None]):
            options = {} if chunk is None else {"chunk_heads": chunk}
            patched = self.sequence(base, transport=transport, **options)
            ms, out, peaks = self.step(patched, inputs, self.args.reps)
            mode = get_sequence_parallel(patched)
            timing = dict(chunk_heads=mode.split.chunk_heads, sequence_ms=round(ms, 1),
                          sequence_times_ms=self.last_times,
                          speedup=round(result["single_ms"] / ms, 3),
                          bit_identical=same(out, single))
            if k == 0:  # the row's figures; other chunk sizes are listed beside them
                result.update(timing,
                              transport=sorted(mode.runner.transports()) if mode.runner
                              else None,
                              steps=dict(mode.steps), peaks=peaks,
                              predicted_activations_GiB=self.predicted(total))
            else:
                result.setdefault("other_chunk_heads", []).append(dict(timing, peaks=peaks))
            mode.release()
            del patched, out
        result["single_ms"] = round(result["single_ms"], 1)
        return result

    def run_emulated_row(self, row: str) -> dict:
        """Both GPUs capped at 32 GiB; the root streams blocks, the helper streams too."""
        inputs, tokens, total = self.inputs(row)
        result = dict(row=row, S=tokens, S_with_text=total, emulated_GiB=32)
        check = row != "emu32_362f" or self.args.verify_362
        single = None
        if check:
            unconstrained_ms, single = self.reference(row, inputs, reps=1)
            result["unconstrained_single_ms"] = round(unconstrained_ms, 1)
        resident = self.resident_blocks(total, one_gpu_too=row != "emu32_362f")
        base = TwinPatcher(self.model, load_device=self.root)
        streamed = apply_block_prefetch(base, PrefetchConfig(resident_blocks=resident,
                                                             lookahead=LOOKAHEAD))
        patched = self.sequence(streamed, helper_weights="stream")
        with self._root_current():
            streamed.apply_model(*self.small)  # registers the streamed blocks: frees their VRAM
        prefetch = get_block_prefetch(streamed)
        try:
            with self.memory_cap():
                if row != "emu32_362f":  # one GPU at 102k does not fit 32 GiB unchunked
                    ms, out, peaks = self.step(streamed, inputs, self.args.reps)
                    result.update(single_streamed_ms=round(ms, 1), single_peaks=peaks,
                                  single_predicted_peak_GiB=self.predicted_single_peak(
                                      total, resident),
                                  single_exact=same(out, single) if check else None)
                    del out
                reps = 1 if row == "emu32_362f" else self.args.reps
                ms, out, peaks = self.step(patched, inputs, reps)
            mode = get_sequence_parallel(patched)
            result.update(sequence_ms=round(ms, 1), sequence_times_ms=self.last_times,
                          bit_identical=same(out, single) if check
                          else None, resident_blocks=resident, peaks=peaks,
                          predicted_activations_GiB=self.predicted(total),
                          predicted_peak_GiB=self.predicted_peaks(total, resident),
                          allocator=allocator_note(self.devices),
                          helper_weights=mode.weights_reason, steps=dict(mode.steps))
            if "single_streamed_ms" in result:
                result["speedup"] = round(result["single_streamed_ms"] / ms, 3)
            mode.release()
        finally:
            if prefetch is not None:
                prefetch.close()  # blocks back on the root GPU for the next rows
        return result

    # ------------------------------------------------------------------ models
    def resident_blocks(self, tokens: int, *, one_gpu_too: bool) -> int:
        """Blocks the root keeps on a 32 GiB card beside its activations: the sequence mode's,
        or (when the one-GPU step runs on the same prefetcher) the larger one-GPU peak."""
        if self.root.type != "cuda":
            return 1
        root_peak = self.predicted_bytes(tokens)[0]
        if one_gpu_too:
            root_peak = max(root_peak, self.single_activation_bytes(tokens))
        budget = EMULATED_BYTES - EMULATION_MARGIN_BYTES - self.other_bytes() - root_peak
        return offload_sizing.resident_blocks_for_budget(
            max(budget, 0), blocks=self.cfg.blocks, block_bytes=self.block_bytes(),
            lookahead=LOOKAHEAD)

    def block_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.blocks[0].parameters())

    def other_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                   if not n.startswith("blocks."))

    def single_activation_bytes(self, tokens: int) -> int:
        return block_sizing.block_peak_bytes(tokens, self.dims(),
                                             kernels=block_sizing.Kernels(mlp="twin")).peak_bytes

    def root_weight_bytes(self, resident: int) -> int:
        streamed = self.cfg.blocks - resident
        slots = offload_sizing.slot_count(LOOKAHEAD, streamed) if streamed else 0
        return self.other_bytes() + (resident + slots) * self.block_bytes()

    def predicted_peaks(self, tokens: int, resident: int) -> dict:
        """The planner's whole-GPU peaks under the emulation: weights (the root's resident
        blocks, slot ring and the rest of the DiT; the helper's K + 1 streamed slots) plus the
        modelled activations (the model's inputs, < 0.3 GiB, are left out)."""
        acts = self.predicted_bytes(tokens)
        helper = sequence_sizing.helper_weight_bytes(self.block_bytes(), self.cfg.blocks,
                                                     replica=False, lookahead=LOOKAHEAD)
        weights = [self.root_weight_bytes(resident)] + [helper] * (len(acts) - 1)
        return {str(d): round((w + a) / GIB, 2)
                for d, w, a in zip(self.devices, weights, acts, strict=True)}

    def predicted_single_peak(self, tokens: int, resident: int) -> float:
        return round((self.root_weight_bytes(resident) + self.single_activation_bytes(tokens))
                     / GIB, 2)

    def dims(self) -> block_sizing.BlockDims:
        cfg = self.cfg
        return block_sizing.BlockDims(hidden=cfg.hidden, heads=cfg.heads, head_dim=cfg.head_dim,
                                      ffn=cfg.ffn, element_bytes=4 if self.args.dry_run else 2)

    def predicted_bytes(self, tokens: int) -> list[int]:
        cfg = self.cfg
        memory = sequence_sizing.sequence_memory(tokens, (cfg.heads // 2,) * 2, dims=self.dims(),
                                                 kernels=block_sizing.Kernels(mlp="twin"))
        return [m.peak for m in memory]

    def predicted(self, tokens: int) -> dict:
        return {str(d): round(b / GIB, 2) for d, b in zip(self.devices,
                                                           self.predicted_bytes(tokens),
                                                           strict=True)}

    @contextlib.contextmanager
    def memory_cap(self):
        if self.root.type != "cuda":
            yield
            return
        for d in self.devices:
            sync(d)
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(EMULATED_BYTES / total, d)
        try:
            yield
        finally:
            for d in self.devices:
                torch.cuda.set_per_process_memory_fraction(1.0, d)


def allocator_note(devices: tuple[torch.device, ...]) -> dict:
    """The allocator settings the emulated rows ran with (expandable segments are needed)."""
    note: dict = {ALLOC_CONF: os.environ.get(ALLOC_CONF)}
    if any(d.type == "cuda" for d in devices):
        segments = torch.cuda.memory_snapshot()
        note["expandable_segments"] = any(seg.get("is_expandable") for seg in segments)
    return note


def same(a, b) -> bool:
    return bool(all(torch.equal(x, y) for x, y in zip(a, b, strict=True)))


def table(rows: list[dict]) -> str:
    lines = ["| row | S | one GPU ms | Dual-Sage | sequence ms | speedup | exact | peaks GiB "
             "(act. measured / predicted) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | - | - | - | - | - | - | {r['error'][:60]} |")
            continue
        one = r.get("single_ms", r.get("single_streamed_ms", "-"))
        dual = f"{r['dual_sage_speedup']:.2f}x" if "dual_sage_speedup" in r else "-"
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        peaks = ", ".join(f"{d} {v['activations_GiB']}/{r['predicted_activations_GiB'][d]}"
                          for d, v in r.get("peaks", {}).items())
        if r.get("peaks") and "predicted_peak_GiB" in r:  # emulated: whole-GPU peaks
            peaks += "; total " + ", ".join(f"{d} {v['peak_GiB']}/{r['predicted_peak_GiB'][d]}"
                                           for d, v in r.get("peaks", {}).items())
        if "single_predicted_peak_GiB" in r and r.get("single_peaks"):
            root = next(iter(r["single_peaks"].values()))  # the one-GPU step: root only
            peaks += f"; one GPU {root['peak_GiB']}/{r['single_predicted_peak_GiB']}"
        lines.append(f"| {r['row']} | {r['S']:,} | {one} | {dual} | {r['sequence_ms']} | "
                     f"{speed} | {r['bit_identical']} | {peaks or '-'} |")
        for other in [r, *r.get("other_chunk_heads", [])] if "other_chunk_heads" in r else []:
            lines.append(f"|   {other['chunk_heads']} heads/call | | | | {other['sequence_ms']} | "
                         f"{other['speedup']:.2f}x | {other['bit_identical']} | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sequence_parallel.json"))
    parser.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ROWS)}")
    parser.add_argument("--reps", type=int, default=2, help="timed steps per case (median)")
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--text-len", type=int, default=256)
    parser.add_argument("--transport", default="auto", choices=["auto", "peer", "host"])
    parser.add_argument("--no-verify-362", dest="verify_362", action="store_false")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny twin, fake devices")
    parser.add_argument("--chunk-heads", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="plain rows: heads per attention call to compare, "
                        "e.g. 4,7,14 (the first is the row's figure; default: the mode's)")
    parser.add_argument("--skip-dual-sage", action="store_true",
                        help="plain rows: leave out the Dual-Sage step")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; use {','.join(ROWS)}")
    if args.dry_run:
        root = helper = torch.device("cpu")
    else:
        if torch.cuda.device_count() < 2:
            print("needs two GPUs (root cuda:1, helper cuda:0); use --dry-run on a CPU")
            return 2
        root, helper = torch.device("cuda", 1), torch.device("cuda", 0)
    started = time.perf_counter()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(sys.argv), torch=torch.__version__,
                  devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                  if root.type == "cuda" else ["cpu"],
                  peer=bool(root.type == "cuda" and torch.cuda.can_device_access_peer(root,
                                                                                      helper)),
                  root=str(root), helper=str(helper), rows=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        bench = Bench(args, root, helper)
        for row in rows:
            try:
                if row.startswith("emu32"):
                    result = bench.run_emulated_row(row)
                else:
                    result = bench.run_plain_row(row)
            except (torch.OutOfMemoryError, RuntimeError) as exc:  # report, keep going
                result = dict(row=row, error=f"{type(exc).__name__}: {exc}"[:500])
                sync(root, helper)
            result["wall_s"] = round(time.perf_counter() - started, 1)
            report["rows"].append(result)
            print(json.dumps(result), flush=True)
            args.out.write_text(json.dumps(report, indent=1))
            gc.collect()
            if root.type == "cuda":
                torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report["rows"]))
    print(f"wall {report['wall_s']} s; json {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
