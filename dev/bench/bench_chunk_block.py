"""One full-size H3 DiT block of a real ComfyUI: upstream's forward against chunking's wrappers.

    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_chunk_block.py --out $OUT/chunk_block.json
    COMFYUI_PATH=... python dev/bench/bench_chunk_block.py --tiny --out /tmp/chunk_block.json  # CPU
    ... --old-tree /path/to/previous/checkout   # also the previous chunked block forward

The block is ComfyUI's own `DiTBlock`, loaded by ComfyUI's loader from a random-weight
checkpoint (`tests/h3_checkpoints.py`, `DiTShape.full` widths, one block) in bf16 and in INT8
ConvRot, on the legacy loader (weights resident: the block's own time is measured). Per weight
format and token count, each variant runs the same input `--reps` times after a warm-up:
- `stock`: upstream's `DiTBlock.forward`, unpatched;
- `chunked`: the same forward with chunking's wrappers on (`--ffn-chunk` / `--qkv-chunk` /
  `--head-group`, default 16384 / 16384 / 14: rows and heads per call);
- `old`: the previous chunked block forward (`chunking.block.ChunkedBlockForward` of a checkout
  given with `--old-tree`, imported as a second package), when given.
Reported: median ms per block, peak activation bytes (`max_memory_allocated` above what was
allocated before the call, the block input included), whether the output equals `stock`'s bit
for bit. JSON to --out, a short table last. About 1-2 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (a code check)")
    p.add_argument("--weights", default="bf16,int8_convrot")
    p.add_argument("--tokens", default="35305,68706", help="rows per block call")
    p.add_argument("--ffn-chunk", type=int, default=16384)
    p.add_argument("--qkv-chunk", type=int, default=16384)
    p.add_argument("--head-group", type=int, default=14)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--old-tree", default=None, help="a checkout of the commit before (its root)")
    return p.parse_args(argv)


def old_forward_class(tree: str | None):
    """The previous ChunkedBlockForward from a checkout at `tree`, or None."""
    if not tree:
        return None
    link_dir = tempfile.mkdtemp(prefix="h3_old_")
    os.symlink(os.path.abspath(tree), os.path.join(link_dir, "h3_multigpu_old"))
    sys.path.insert(0, link_dir)
    try:
        from h3_multigpu_old.chunking.block import ChunkedBlockForward
    except ImportError as exc:
        print(f"old: not importable from {tree} ({exc})", flush=True)
        return None
    return ChunkedBlockForward


def block_inputs(block, tokens: int, device, dtype, h3):
    gen = torch.Generator().manual_seed(tokens)
    hidden = block.norm1.weight.shape[0]
    t_dim = block.adaln_proj.linear.in_features
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    t_emb = torch.randn(2, t_dim, generator=gen).to(device)
    text = min(256, tokens // 4)
    audio = min(2 * 406, tokens // 4)
    segments = [(0, text, 1), (text, text + audio, 5), (text + audio, tokens, 0)]
    rot = 96  # H3's rotated dims: 3 axes x 16 frequencies, both halves
    angles = torch.randn(tokens, rot, generator=gen).to(device)
    return x, t_emb, segments, h3.rope_rotation_table(angles, dtype)


def call_variants(block, runtime, options, old_cls, config, t_emb, segments, rope) -> dict:
    """name -> fn(x): one block call on x (modified in place, as upstream's block does)."""
    def stock(xi):
        return block.forward(xi, t_emb, segments, rope, transformer_options={})

    def chunked(xi):
        with runtime.wrapped():
            return block.forward(xi, t_emb, segments, rope, transformer_options=options)

    variants = {"stock": stock, "chunked": chunked}
    if old_cls is not None:
        old = old_cls(block, config)
        variants["old"] = lambda xi: old(xi, t_emb, segments, rope, transformer_options={})
    return variants


def timed(fn, x, reps: int, device):
    """(output, median seconds, peak bytes above the start, block input included)."""
    cuda = device.type == "cuda"
    out = fn(x.clone())  # warm-up (kernels, cuBLAS workspaces, weight casts)
    del out
    times, peak = [], 0
    for _ in range(reps):
        xi = x.clone()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) - xi.numel() * xi.element_size()
        t0 = time.perf_counter()
        out = fn(xi)
        if cuda:
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), (peak if cuda else None)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        comfy.cli_args.args.cpu = True
    from comfyui_h3 import TinyH3Config, import_comfyui, make_tiny_h3

    comfy = import_comfyui()
    from h3_multigpu.chunking import ChunkingConfig
    from h3_multigpu.chunking.wrappers import BlockChunker, ChunkingRuntime, HeadGroups
    from h3_multigpu.comfy_seam import names

    h3 = comfy.ldm.minimax.model
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    old_cls = old_forward_class(args.old_tree)
    tokens_list = [int(t) for t in args.tokens.split(",")] if not args.tiny else [300, 520]
    config = ChunkingConfig(ffn_chunk=args.ffn_chunk, qkv_chunk=args.qkv_chunk,
                            head_group=args.head_group)
    if args.tiny:
        config = ChunkingConfig(ffn_chunk=128, qkv_chunk=96, head_group=1)
    rows, results = [], {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                         "torch": torch.__version__, "config": vars(args), "cases": []}
    for weights in args.weights.split(","):
        shape = dict(hidden=256, heads=2, head_dim=128, ffn=512) if args.tiny else dict(
            hidden=5376, heads=56, head_dim=128, ffn=14336)
        tiny = TinyH3Config(**shape, blocks=1, refiner_blocks=1, dtype=torch.bfloat16,
                            weights="float" if weights == "bf16" else weights)
        t0 = time.perf_counter()
        # ComfyUI loads and moves models inside inference mode (execution.py); its weights are
        # inference tensors that a move outside it cannot re-version
        with torch.inference_mode():
            patcher = make_tiny_h3(tiny, seed=0, load_device=device)
            comfy.model_management.load_models_gpu([patcher])
        block = patcher.model.diffusion_model.blocks[0]
        load_s = time.perf_counter() - t0
        runtime = ChunkingRuntime()
        runtime.chunkers[0] = BlockChunker(block, config, None, runtime)
        options = {names.OVERRIDE_KEY: HeadGroups(runtime)}
        for tokens in tokens_list:
            x, t_emb, segments, rope = block_inputs(block, tokens, device, torch.bfloat16, h3)

            variants = call_variants(block, runtime, options, old_cls, config, t_emb, segments,
                                     rope)
            reference = None
            with torch.inference_mode():
                for name, fn in variants.items():
                    try:
                        out, seconds, peak = timed(fn, x, args.reps, device)
                    except torch.OutOfMemoryError as exc:
                        case = {"weights": weights, "tokens": tokens, "variant": name,
                                "error": f"out of memory: {exc}"[:200]}
                        results["cases"].append(case)
                        continue
                    if reference is None:
                        reference = out.to("cpu")
                    same = bool(torch.equal(out.to("cpu"), reference))
                    del out
                    case = {"weights": weights, "tokens": tokens, "variant": name,
                            "ms_per_block": seconds * 1e3, "peak_bytes": peak,
                            "equal_to_stock": same, "load_s": load_s,
                            "chunk_calls": dict(runtime.chunkers[0].calls)
                            if name == "chunked" else None}
                    results["cases"].append(case)
                    rows.append(case)
                    print(f"{weights} S={tokens} {name}: {seconds * 1e3:.2f} ms, peak "
                          f"{(peak or 0) / 2**30:.2f} GiB, equal {same}", flush=True)
            x = t_emb = rope = reference = None
        block = runtime = patcher = None
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{'weights':<13}{'S':>8}  {'variant':<8}{'ms/block':>10}{'peak GiB':>10}  equal")
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        print(f"{r['weights']:<13}{r['tokens']:>8}  {r['variant']:<8}{r['ms_per_block']:>10.2f}"
              f"{peak:>10}  {r['equal_to_stock']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
