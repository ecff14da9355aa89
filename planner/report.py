"""Readable and JSON renderings of a Plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .hardware import GiB

if TYPE_CHECKING:
    from .plan import Plan


def _gib(n: int) -> str:
    return f"{n / GiB:6.1f}"


def render_report(plan: Plan) -> str:
    r = plan.request
    lines = [
        f"H3 multi-GPU plan: {plan.profile.name} ({plan.profile.description})",
        f"job: PASS1 {plan.pass1.width}x{plan.pass1.height} -> PASS2 {plan.pass2.describe()}; "
        f"tokens PASS1 {plan.pass1.tokens:,}, PASS2 {plan.pass2.tokens:,} "
        f"(+{r.text_tokens} text); DiT {r.dit_dtype}, {plan.sizes.source}"
        + (f"; LoRA rank {r.lora_rank} on activations" if r.lora_rank else ""),
        "",
        f"{'GPU':<5} {'role':<11} {'phase':<15} {'weights':>8} {'activ.':>8} {'worksp.':>8} "
        f"{'peak':>8} {'headroom':>9}  (GiB)",
    ]
    for g in plan.gpus:
        usable = g.capacity_bytes - g.reserve_bytes
        for i, (phase, mem) in enumerate(g.phases.items()):
            head = f"gpu:{g.index}" if i == 0 else ""
            role = g.role if i == 0 else ""
            flag = "" if mem.peak <= usable else "  <-- does not fit"
            lines.append(f"{head:<5} {role:<11} {phase:<15} {_gib(mem.weights):>8} "
                         f"{_gib(mem.activations):>8} {_gib(mem.workspace):>8} "
                         f"{_gib(mem.peak):>8} {_gib(usable - mem.peak):>9}{flag}")
        lines.append(f"{'':<5} {g.name} ({g.capacity_bytes / GiB:.1f} GiB, "
                     f"{g.reserve_bytes / GiB:.1f} GiB kept free for fragmentation/runtime)")
    ds, ch, pf = plan.dual_sage, plan.chunking, plan.prefetch
    place = ", ".join(f"{k} gpu:{v}" for k, v in plan.placement.items())
    lines += ["", "decisions:", f"  placement: {place}"]
    modes = {p.mode for p in plan.parallel.passes.values()} if plan.parallel else set()
    if ds.enabled and modes == {"sequence"}:
        # every pass runs sequence parallel: head sharding is configured but idle unless a
        # step falls back to heads mode (short steps, a helper below its row floor)
        split = "+".join(str(h) for h in ds.split)
        lines.append(f"  Dual-Sage: standby, heads {split}, {ds.transport} transport -- both "
                     "passes run sequence parallel (below); it shards only a step that falls "
                     f"back to heads mode (alone it would give: {ds.reason})")
    elif ds.enabled:
        split = "+".join(str(h) for h in ds.split)
        lines.append(f"  Dual-Sage: on, heads {split} (root gpu:{plan.root_device} first), "
                     f"{ds.transport} transport, min_tokens {ds.min_tokens:,} -- {ds.reason}")
    else:
        lines.append(f"  Dual-Sage: off -- {ds.reason}")
    if ch.ffn_chunk or ch.qkv_chunk or ch.head_group:
        lines.append(f"  chunking: FFN {ch.ffn_chunk} rows, QKV {ch.qkv_chunk} rows, "
                     f"{ch.head_group} heads per attention call -- {ch.reason}")
    else:
        lines.append(f"  chunking: off -- {ch.reason}")
    if plan.loader is not None:
        lines.append(f"  loader: {plan.loader.describe()}")
    lines.append(f"  DiT blocks: {pf.resident_blocks} resident, {pf.streamed_blocks} streamed"
                 f" -- {pf.reason}")
    if plan.parallel is not None:
        for name in plan.parallel.passes:
            lines.append(f"  parallel {name.upper()}: {plan.parallel.describe(name)}")
    if plan.decode is not None:
        lines.append(f"  video decode: {plan.decode.describe()}")
    lines.append("")
    for name in ("pass1", "pass2"):
        t, t1 = plan.step_time_s[name], plan.single_gpu_step_time_s[name]
        lines.append(f"  predicted {name.upper()} step: {t:6.2f} s/it"
                     + (f" (root GPU alone {t1:.2f} s/it, {t1 / t:.2f}x)" if t1 != t else ""))
    if plan.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in plan.notes]
    lines.append("")
    if plan.fits:
        lines.append("FITS: every GPU keeps its reserve free in every phase.")
    else:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
        lines.append("smallest changes that fit:")
        lines += [f"  - {s}" for s in plan.suggestions]
    lines.append("(the latent-upscale workspace is an estimate; the decode's memory and time are "
                 "measured on an H200 at 1312x736; DiT activations follow the block's tensors, "
                 "checked on a GPU: docs/BENCHMARKS.md)")
    return "\n".join(lines)


def plan_to_dict(plan: Plan) -> dict:
    r = plan.request
    return {
        "fits": plan.fits,
        "tokens": plan.pass2.tokens,
        "tokens_pass1": plan.pass1.tokens,
        "text_tokens": r.text_tokens,
        "frames": plan.pass2.frames,
        "seconds": round(plan.pass2.seconds, 3),
        "pass1": {"width": plan.pass1.width, "height": plan.pass1.height},
        "pass2": {"width": plan.pass2.width, "height": plan.pass2.height},
        "profile": plan.profile.name,
        "root_device": plan.root_device,
        "helper_devices": list(plan.helper_devices),
        "placement": dict(plan.placement),
        "gpus": [
            {
                "index": g.index,
                "role": g.role,
                "name": g.name,
                "capacity_bytes": g.capacity_bytes,
                "reserve_bytes": g.reserve_bytes,
                "peak_bytes": g.peak_bytes,
                "headroom_bytes": g.headroom_bytes,
                "phases": {k: {"weights": v.weights, "activations": v.activations,
                               "workspace": v.workspace, "peak": v.peak}
                           for k, v in g.phases.items()},
            }
            for g in plan.gpus
        ],
        "dual_sage": {"enabled": plan.dual_sage.enabled,
                      "helper_devices": list(plan.dual_sage.helper_devices),
                      "split": list(plan.dual_sage.split),
                      "min_tokens": plan.dual_sage.min_tokens,
                      "transport": plan.dual_sage.transport, "reason": plan.dual_sage.reason},
        "chunking": {"ffn_chunk": plan.chunking.ffn_chunk, "qkv_chunk": plan.chunking.qkv_chunk,
                     "head_group": plan.chunking.head_group, "reason": plan.chunking.reason},
        "prefetch": {"resident_blocks": plan.prefetch.resident_blocks,
                     "streamed_blocks": plan.prefetch.streamed_blocks,
                     "lookahead": plan.prefetch.lookahead,
                     "pinned_budget_bytes": plan.prefetch.pinned_budget_bytes,
                     "source": plan.prefetch.source, "reason": plan.prefetch.reason,
                     "streamer": plan.prefetch.streamer,
                     "streamed_refiner_blocks": plan.prefetch.streamed_refiner_blocks,
                     "staged_blocks": plan.prefetch.staged_blocks},
        "loader": None if plan.loader is None else {
            "mode": plan.loader.mode, "reason": plan.loader.reason,
            "pinned_budget_bytes": plan.loader.pinned_budget_bytes,
            "pinned_budget_source": plan.loader.pinned_budget_source},
        "parallel": None if plan.parallel is None else {
            "requested": plan.parallel.requested, "transport": plan.parallel.transport,
            "row_weights": list(plan.parallel.row_weights),
            "head_split": list(plan.parallel.head_split),
            "passes": {n: {"mode": p.mode, "reason": p.reason, "speedup": round(p.speedup, 3),
                           "step_time_s": p.step_time_s, "helper_weights": p.helper_weights,
                           "root_activation_bytes": p.root_activation_bytes,
                           "helper_activation_bytes": p.helper_activation_bytes,
                           "helper_weight_bytes": p.helper_weight_bytes}
                       for n, p in plan.parallel.passes.items()}},
        "decode": None if plan.decode is None else {
            "devices": list(plan.decode.devices),
            "windows": [list(r) for r in plan.decode.windows],
            "seconds": plan.decode.seconds, "single_gpu_seconds": plan.decode.single_seconds,
            "peak_bytes": {str(k): v for k, v in plan.decode.peak_bytes.items()},
            "make_room": plan.decode.make_room, "reason": plan.decode.reason},
        "step_time_s": dict(plan.step_time_s),
        "single_gpu_step_time_s": dict(plan.single_gpu_step_time_s),
        "notes": list(plan.notes),
        "problems": list(plan.problems),
        "suggestions": list(plan.suggestions),
    }
