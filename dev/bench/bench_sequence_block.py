"""Per-block cost: upstream's own H3 block per share (today's sequence runner) vs the old runner.

One GPU, ComfyUI's real H3 block at full size (tests/h3_checkpoints.py DiTShape.full, one DiT
block, written and loaded by ComfyUI's loader), INT8 ConvRot and bf16. Both runners split one
block over two "devices" that are the same GPU (the helper share runs a second copy of the
block: a ComfyUI-loaded second model), so both do the same GPU work and the difference is what
the runner adds: host threads, rendezvous and the exchange's copies (new) against one host
thread issuing a re-stated block (old, kept in dev/bench/legacy_sequence_runner.py). Each block's
output is checked bit for bit against the unsplit block.

    PYTHONPATH=<folder holding h3_multigpu> COMFYUI_PATH=/path/to/ComfyUI \
        python dev/bench/bench_sequence_block.py --out $OUT/seq_block.json
    COMFYUI_PATH=... python dev/bench/bench_sequence_block.py --tiny --out /tmp/seq.json  # CPU

Default rows: 68,706 (PASS2 1312x736 243 f); --rows to change. About 1-2 minutes on one H200.
JSON to --out, short table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny block, few rows")
    p.add_argument("--formats", default="int8_convrot,bf16")
    p.add_argument("--rows", type=int, default=68_706)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_block(fmt: str, tiny: bool, device: torch.device, workdir: str):
    from comfyui_h3 import load_dit
    from h3_checkpoints import DiTShape, write_dit

    shape = replace(DiTShape.tiny(heads=4) if tiny else DiTShape.full(), blocks=1)
    path = os.path.join(workdir, f"dit_{fmt}_{'tiny' if tiny else 'full'}.safetensors")
    if not os.path.exists(path):
        write_dit(path, shape, fmt, seed=0)
    import comfy.model_management as mm

    models = []
    # ComfyUI loads and moves models inside inference mode (execution.py); its loaded weights
    # are inference tensors that a move outside it cannot re-version
    with torch.inference_mode():
        for _ in range(2):  # the root's and the "helper's" (a second ComfyUI-loaded model)
            patcher = load_dit(path, dtype=torch.bfloat16, load_device=device)
            mm.load_models_gpu([patcher], force_full_load=True)
            models.append(patcher)
    return models, shape


def _inputs(shape, rows: int, device: torch.device):
    from comfy.ldm.minimax.model import rope_rotation_table

    gen = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(rows, shape.hidden, generator=gen) * 0.5).to(device, torch.bfloat16)
    t_emb = torch.randn(2, shape.time_embed_dim, generator=gen).to(device)
    angles = torch.randn(rows, 96, generator=gen).to(device)
    rope = rope_rotation_table(angles, torch.bfloat16)
    cut = rows // 3
    segments = [(0, cut, 1), (cut, rows, 3)]
    return x, t_emb, segments, rope


def _time(fn, iters: int, warmup: int, device: torch.device) -> list[float]:
    out = []
    for i in range(warmup + iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            out.append((time.perf_counter() - start) * 1e3)
    return out


def bench_format(fmt: str, args, device: torch.device, workdir: str) -> dict:
    from h3_multigpu.exchange.transport import TransportMode
    from h3_multigpu.sequence import split as sequence_split
    from h3_multigpu.sequence.plan import block_args, positional
    from h3_multigpu.sequence.runner import SequenceRunner
    from h3_multigpu.sequence.split import SequenceSplit

    sequence_split.ALLOW_SHARED_GPU = True  # both shares on this one GPU (see the docstring)
    (root, helper), shape = _load_block(fmt, args.tiny, device, workdir)
    block = root.model.diffusion_model.blocks[0]
    helper_block = helper.model.diffusion_model.blocks[0]
    x, t_emb, segments, rope = _inputs(shape, args.rows, device)
    devices = (device, device)
    split = SequenceSplit.even(devices, shape.heads, chunk_heads=7 if not args.tiny else 2,
                               min_rows=1)
    result: dict = {"format": fmt, "rows": args.rows, "shares": split.rows_for(args.rows)}
    with torch.inference_mode():
        reference = block(x.clone(), t_emb, segments, rope, transformer_options={})
        one = _time(lambda: block(x.clone(), t_emb, segments, rope, transformer_options={}),
                    args.iters, args.warmup, device)
        result["one_block_ms"] = one

        runner = SequenceRunner(split, TransportMode.PEER)

        def new() -> torch.Tensor:
            h = x.clone()
            state = runner.scatter(block_args(h, t_emb, segments, rope))
            calls = [lambda a, o: block(*positional(a), transformer_options=o),
                     lambda a, o: helper_block(*positional(a), transformer_options=o)]
            runner.run_block(state, calls, {}, [block, helper_block])
            runner.gather(state)
            return h

        result["upstream_per_share_exact"] = torch.equal(new(), reference)
        result["upstream_per_share_ms"] = _time(new, args.iters, args.warmup, device)
        result["attention_calls"] = runner.attention_calls
        runner.close()

        try:
            from h3_multigpu.bench import legacy_sequence_runner as legacy
        except Exception as exc:  # the old runner's helpers may have moved: say so
            result["legacy_runner_error"] = f"{type(exc).__name__}: {exc}"
        else:
            old = legacy.SequenceRunner(split, TransportMode.PEER, {1: _SameDevice()})

            def old_block() -> torch.Tensor:
                h = x.clone()
                state = old.scatter(h, t_emb, rope, segments)
                old.run_block(state, 0, block, {})
                old.gather(state)
                return h

            result["legacy_runner_exact"] = torch.equal(old_block(), reference)
            result["legacy_runner_ms"] = _time(old_block, args.iters, args.warmup, device)
            old.close()
    for patcher in (root, helper):
        patcher.detach()
    return result


class _SameDevice:
    """The old runner's helper weights when the helper is the root's own GPU: nothing to bind."""

    def begin(self, index: int) -> None:
        pass

    def end(self, index: int) -> None:
        pass

    @contextlib.contextmanager
    def use(self, index: int):
        yield


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.rows = min(args.rows, 160)
        args.iters, args.warmup = min(args.iters, 3), 1
    from comfyui_h3 import import_comfyui

    import_comfyui()
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() \
        else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(max(2, torch.get_num_threads()))
    results = []
    with tempfile.TemporaryDirectory(prefix="h3_seq_block_") as workdir:
        for fmt in [f for f in args.formats.split(",") if f]:
            results.append(bench_format(fmt, args, device, workdir))
    payload = {"device": str(device), "name": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "results": results}
    Path(args.out).write_text(json.dumps(payload, indent=2))

    def med(values) -> str:
        return f"{sorted(values)[len(values) // 2]:9.2f}" if values else "        -"

    print(f"{'format':14} {'rows':>7} {'one block':>9} {'per share':>9} {'old':>9}  exact(new/old)")
    for r in results:
        print(f"{r['format']:14} {r['rows']:7d} {med(r['one_block_ms'])} "
              f"{med(r['upstream_per_share_ms'])} {med(r.get('legacy_runner_ms', []))}  "
              f"{r['upstream_per_share_exact']}/{r.get('legacy_runner_exact', '-')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
