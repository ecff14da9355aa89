"""Dual-Sage benchmark: one attention call and one full twin denoising step, one GPU vs two.

Run on a machine with two GPUs (root cuda:1 as in production, helper cuda:0):
    COMFYUI_PATH=/path/to/ComfyUI python dev/bench/bench_dual_sage.py --out $OUT/dual_sage.json
Dual-Sage shards the attention function ComfyUI would run: with COMFYUI_PATH importable, the
call bench runs ComfyUI's own `attention_pytorch` (SDPA under ComfyUI's backend priority) on every
head subset; without it, the pack's `sdpa` backend (the row says which). Every ratio is against
the single-GPU call of the same function in the same process. Attention inputs are H3's strided
`[1, 56, S, 128]` views of a `[S, 21504]` bf16 qkv buffer. The step bench runs the twin's full
PASS2 forward (its attention: PyTorch SDPA), plain vs Dual-Sage with the default settings.
`--dry-run` runs every code path on the CPU with tiny sizes (fake devices).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from h3_multigpu.common import geometry
from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    ShardPlan,
    TransportMode,
    apply_dual_sage,
)
from h3_multigpu.dual_sage import sizing as dual_sage_sizing
from h3_multigpu.dual_sage.apply import per_heads
from h3_multigpu.kernels import list_backends
from h3_multigpu.kernels.comfy_calling import backend_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the twin lives in tests/
from twin import TwinConfig, TwinPatcher, comfyui_attention, make_inputs, make_twin  # noqa: E402

GIB = 1 << 30
SIZES = (15_399, 35_305, 68_706, 102_107)


def sync(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def timed_ms(fn, devices, reps: int) -> tuple[float, object]:
    """Median wall time of `reps` calls after one warm-up, both GPUs synchronised around each."""
    out = fn()
    times = []
    for _ in range(reps):
        sync(*devices)
        start = time.perf_counter()
        out = fn()
        sync(*devices)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out


def strided_qkv(seq_len, heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(seq_len, 3 * heads * head_dim, generator=gen, device=device, dtype=dtype)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in qkv.split(heads * head_dim, dim=-1))


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def comfyui_function() -> tuple[object | None, str]:
    """ComfyUI's `attention_pytorch` from $COMFYUI_PATH, or None and why not."""
    root = os.environ.get("COMFYUI_PATH")
    if not root:
        return None, "COMFYUI_PATH unset"
    try:
        sys.path.insert(0, root)
        import comfy.cli_args
        import comfy.options  # noqa: F401  (sys.argv is not parsed)

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True  # a dry run: ComfyUI's CPU mode
        from comfy.ldm.modules import attention as comfy_attention
    except Exception as exc:  # any import failure: fall back, and say so in the rows
        return None, f"ComfyUI not importable: {type(exc).__name__}: {exc}"
    return comfy_attention.attention_pytorch, "ComfyUI attention_pytorch"


def attention_functions(names: list[str], root: torch.device) -> dict[str, tuple[object, str]]:
    """{row name: (function in ComfyUI's convention, what it is)}."""
    available = {r.name: r.available for r in list_backends()}
    out = {}
    for name in names:
        if name == "comfyui":
            function, what = comfyui_function()
            out[name] = (function, what) if function is not None else (
                backend_function("sdpa"), f"pack sdpa ({what})")
        elif available.get(name) and (name == "sdpa" or root.type == "cuda"):
            out[name] = (backend_function(name), f"pack {name}")
    return out


def bench_attention(args, root, helper, heads, head_dim, dtype, sizes) -> list[dict]:
    rows = []
    functions = attention_functions(args.backends.split(","), root)
    for seq_len in sizes:
        views = strided_qkv(seq_len, heads, head_dim, dtype, root)
        for backend, (function, what) in functions.items():
            chosen = getattr(function, "backend", None)
            if chosen is not None and chosen.violations(*views):
                continue
            reps = args.reps if seq_len < 60_000 else max(3, args.reps - 2)
            single_ms, single = timed_ms(
                lambda f=function, t=views: f(*t, heads, skip_reshape=True), (root,), reps)
            attend = per_heads(function, {"skip_reshape": True})
            transports = [TransportMode.PEER, TransportMode.HOST] if backend == "comfyui" \
                else [TransportMode.PEER]
            variants = [(t, c) for t in transports for c in args.chunk_heads or
                        [dual_sage_sizing.chunk_heads_for(t is TransportMode.HOST)]]
            for transport, chunk_heads in variants:
                shard = ShardedAttention(ShardPlan((root, helper), (heads // 2, heads // 2)),
                                         transport=transport, min_tokens=0,
                                         chunk_heads=chunk_heads)
                shard(*views, attend)  # allocates the workspace (and pinned slots) once
                reset_peak(helper)
                split_ms, out = timed_ms(lambda s=shard, t=views, a=attend: s(*t, a),
                                         (root, helper), reps)
                row = dict(S=seq_len, backend=backend, function=what,
                           transport=transport.value,
                           chunk_heads=chunk_heads,
                           single_ms=round(single_ms, 2), split_ms=round(split_ms, 2),
                           speedup=round(single_ms / split_ms, 3),
                           bit_identical=bool(torch.equal(out, single)),
                           max_abs_diff=float((out.float() - single.float()).abs().max()),
                           rel_l2_vs_single=float((out.float() - single.float()).norm()
                                                  / single.float().norm()),
                           route=shard.last_route, helper_peak_GiB=peak_gib(helper))
                rows.append(row)
                print(json.dumps(row), flush=True)
                del shard, out
                gc.collect()
            del single
        del views
        if root.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_step(args, root, helper) -> dict:
    """One denoising step (forward of the whole DiT), plain vs Dual-Sage on the same model.

    With ComfyUI importable the twin's attention goes through ComfyUI's own dispatch (its
    `optimized_attention`: SDPA under its backend priority on CUDA), as upstream H3's does.
    """
    function, what = comfyui_function()
    with contextlib.ExitStack() as stack:
        if function is not None:
            from comfy.ldm.modules import attention as comfy_attention

            stack.enter_context(comfyui_attention(comfy_attention))
            what = f"ComfyUI optimized_attention ({comfy_attention.optimized_attention.__name__})"
        else:
            what = f"twin attention_pytorch ({what})"
        return _bench_step(args, root, helper, what)


def _bench_step(args, root, helper, what: str) -> dict:
    if args.dry_run:
        cfg = TwinConfig.tiny()
        model = make_twin(cfg, device=root)
        dims = dict(latent_t=5, latent_h=8, latent_w=10, audio_t=40, text_len=16)
        dtype = torch.float32
    else:
        cfg = TwinConfig.full(blocks=args.step_blocks)
        # weights drawn on the GPU: seconds instead of minutes for 19 B parameters
        model = make_twin(cfg, dtype=torch.bfloat16, device=root, init_on_device=True)
        frames = 243
        lat = geometry.latent_shape(1312, 736, frames)
        dims = dict(latent_t=lat[2], latent_h=lat[3], latent_w=lat[4],
                    audio_t=geometry.audio_latent_steps(frames), text_len=args.text_len)
        dtype = torch.bfloat16
    inputs = make_inputs(cfg, dtype=dtype, device=root, **dims)
    small = make_inputs(cfg, dtype=dtype, device=root, latent_t=2, latent_h=8, latent_w=8,
                        audio_t=4, text_len=16)
    base = TwinPatcher(model, load_device=root)
    plain = base
    backend = args.step_backend
    if backend != "comfyui":
        # the single-GPU baseline runs the same kernel, installed as the model's attention
        plain = base.clone()
        kernel = backend_function(backend)
        plain.set_model_optimized_attention(
            lambda func, q, k, v, heads, **kw: kernel(q, k, v, heads, **kw))
    helpers = ("cpu",) if root.type == "cpu" else (str(helper),)
    dual = apply_dual_sage(base, DualSageConfig(helpers=helpers, backend=backend,
                                                min_tokens=0 if args.dry_run else None))
    results = {}
    outputs = {}
    cases = [("single", plain), ("dual_sage", dual)]
    if backend != "comfyui":
        cases.insert(0, ("single_sdpa", base))
    for name, patcher in cases:
        patcher.apply_model(*small)  # kernels and handles warm, without the big allocations
        times = []
        for _ in range(args.step_reps):
            sync(root, helper)
            start = time.perf_counter()
            outputs[name] = patcher.apply_model(*inputs)
            sync(root, helper)
            times.append((time.perf_counter() - start) * 1e3)
        results[name] = statistics.median(times)
    seq = inputs[0][0].shape[2] * inputs[0][0].shape[3] * inputs[0][0].shape[4] // 4
    seq += 2 * inputs[0][1].shape[-1]
    identical = all(torch.equal(a, b) for a, b in zip(outputs["single"], outputs["dual_sage"],
                                                      strict=True))
    status = dual.model_options["transformer_options"]["h3_multigpu"]["dual_sage"]
    routes = dict(dual.model_options["transformer_options"][
        "optimized_attention_override"].sharded.routes)
    row = dict(backend=backend, function=what, blocks=cfg.blocks, tokens_video_audio=seq,
               routes=routes,
               text_len=dims["text_len"],
               single_sdpa_ms=round(results.get("single_sdpa", results["single"]), 1),
               single_ms=round(results["single"], 1), dual_sage_ms=round(results["dual_sage"], 1),
               speedup=round(results["single"] / results["dual_sage"], 3),
               bit_identical=identical, status=status)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], step: dict | None) -> str:
    lines = ["| S | backend | transport | single ms | split ms | speedup | exact | helper GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gib = "-" if r["helper_peak_GiB"] is None else f"{r['helper_peak_GiB']:.2f}"
        lines.append(f"| {r['S']:,} | {r['backend']} | {r['transport']} | {r['single_ms']} | "
                     f"{r['split_ms']} | {r['speedup']:.2f}x | {r['bit_identical']} | {gib} |")
    if step:
        lines.append(f"\nstep ({step['blocks']} blocks, S={step['tokens_video_audio']:,}+"
                     f"{step['text_len']} text): single {step['single_ms']} ms, Dual-Sage "
                     f"{step['dual_sage_ms']} ms, {step['speedup']:.2f}x, bit-identical "
                     f"{step['bit_identical']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("dual_sage.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, fake devices")
    parser.add_argument("--sizes", type=str, default=",".join(map(str, SIZES)))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--step-blocks", type=int, default=50)
    parser.add_argument("--step-reps", type=int, default=1)
    parser.add_argument("--text-len", type=int, default=256)
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--chunk-heads", type=lambda t: [int(x) for x in t.split(",")],
                        default=None, help="helper heads per transfer chunk, e.g. 4 or "
                        "2,4,7,14 (default: the pack's per transport: 14 peer, 4 host relay)")
    parser.add_argument("--backends", default="comfyui,ck_int8",
                        help="comfyui (ComfyUI's attention_pytorch, else the pack's sdpa) and "
                             "pack backends")
    parser.add_argument("--step-backend", default="comfyui",
                        help="attention of the step: comfyui (the model's own, sharded) or a "
                             "pack backend (single GPU and Dual-Sage alike)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.dry_run:
        root = helper = torch.device("cpu")
        heads, head_dim, dtype, sizes = 8, 16, torch.float32, (300, 517)
    else:
        if torch.cuda.device_count() < 2:
            print("needs two GPUs (root cuda:1, helper cuda:0); use --dry-run on a CPU")
            return 2
        root, helper = torch.device("cuda", 1), torch.device("cuda", 0)
        heads, head_dim, dtype = 56, 128, torch.bfloat16
        sizes = tuple(int(s) for s in args.sizes.split(","))
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(sys.argv), torch=torch.__version__,
                  devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                  if root.type == "cuda" else ["cpu"],
                  peer=bool(root.type == "cuda" and torch.cuda.can_device_access_peer(root,
                                                                                      helper)),
                  root=str(root), helper=str(helper))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if root.type == "cuda":  # the DiT runs with its root GPU current, as in production
            stack.enter_context(torch.cuda.device(root))
        rows = [] if args.skip_attention else bench_attention(args, root, helper, heads,
                                                              head_dim, dtype, sizes)
        report["attention"] = rows
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        step = None
        if not args.skip_step:
            step = bench_step(args, root, helper)
            report["step"] = step
    report["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(rows, step))
    print(f"wall {report['wall_s']} s; json {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
