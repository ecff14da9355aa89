"""Readable and JSON renderings of a Plan: the same facts, in the same words.

The text answers in its first three lines (the verdict with the whole job's time, where that
time goes, the job), then one line per GPU, the decisions, one line of advice (to fit, or to go
faster), notes and the memory of every phase; every line wraps at 100 columns.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from .hardware import GiB
from .layout import MODE_WORDS
from .modes import LABELS
from .timing import duration

if TYPE_CHECKING:
    from .plan import Plan

WIDTH = 100
COMPONENT_WORDS = {"text_encoder": "text encoder", "video_vae": "video VAE",
                   "audio_vae": "audio VAE", "latent_upscaler": "latent upscaler", "dit": "DiT",
                   "sampler": "sampler"}


def verdict_word(plan: Plan) -> str:
    if not plan.fits:
        return "DOES NOT FIT"
    return "FITS (tight)" if plan.verdict.tight else "FITS"


def _wrap(text: str, indent: str = "", more: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                         break_on_hyphens=False, break_long_words=True)


def _steps_words(plan: Plan) -> str:
    job = plan.job_time
    parts = [f"{LABELS[n]} {s}" for n, s in (("pass1", job.pass1_steps),
                                             ("pass2", job.pass2_steps)) if s]
    return " + ".join(parts) + " steps"


def _headline(plan: Plan) -> list[str]:
    """Line 1: the verdict and the whole job's time; 2: where the time goes; 3: the job."""
    job = plan.job_time
    word = verdict_word(plan)
    if plan.fits:
        parts = ", ".join([_steps_words(plan), *(["upscale"] if job.upscale_s else []), "decode"])
        first = (f"{word}: the whole job ~{duration(job.total_s)} on {plan.profile.name} "
                 f"({parts})")
    else:
        over = next(((g, k) for g in plan.gpus for k, m in g.phases.items()
                     if m.peak > g.usable_bytes), None)
        if over is not None:
            g, phase = over
            what = (f"gpu:{g.index} {phase} needs {g.phases[phase].peak / GiB:.1f} of "
                    f"{g.usable_bytes / GiB:.1f} GiB")
        else:  # only the host's RAM is short
            host = plan.host
            what = (f"host RAM needs {host.needed_bytes / GiB:.1f} of "
                    f"{host.available_bytes / GiB:.1f} GiB")
        first = (f"{word} on {plan.profile.name}: {what}; the job as planned "
                 f"~{duration(job.total_s)}")
    passes = [f"{LABELS[n]} {steps} x {_r(plan.step_time_s[n], 1):.1f} s = "
              f"{duration(steps * plan.step_time_s[n])}"
              for n, steps in (("pass1", job.pass1_steps), ("pass2", job.pass2_steps)) if steps]
    upscale = [f"upscale {duration(job.upscale_s)}"] if job.upscale_s else []
    second = f"time: {', '.join([*passes, *upscale, f'decode {duration(job.decode_s)}'])}"
    r = plan.request
    third = (f"job: {plan.pass2.width}x{plan.pass2.height} (PASS1 {plan.pass1.width}x"
             f"{plan.pass1.height}), {plan.pass2.frames} frames = {plan.pass2.seconds:.1f} s, "
             f"DiT {r.dit_dtype}, attention {plan.attention.kernel}"
             + (f", LoRA rank {r.lora_rank}" if r.lora_rank else "")
             + (f", CFG {r.pass1_cfg:g} (PASS1) / {r.pass2_cfg:g} (PASS2)"
                if (r.pass1_cfg, r.pass2_cfg) != (1.0, 1.0) else ""))
    return [*_wrap(first), *_wrap(second), *_wrap(third)]


def _gpu_line(plan: Plan, g) -> list[str]:
    state = ""
    if any(p.startswith(f"gpu:{g.index} ") for p in plan.problems):
        state = ": DOES NOT FIT"
    elif any(t.startswith(f"gpu:{g.index} ") for t in plan.verdict.tight):
        state = ": tight"
    spare = g.headroom_bytes
    left = f"{spare / GiB:.1f} spare" if spare >= 0 else f"{-spare / GiB:.1f} over"
    return _wrap(f"gpu:{g.index} {g.role:<6} peak {g.peak_bytes / GiB:.1f} of "
                 f"{g.usable_bytes / GiB:.1f} GiB ({g.peak_phase}), {left}{state}  {g.name}")


def _dual_sage_words(plan: Plan) -> str:
    ds = plan.dual_sage
    split = "+".join(str(h) for h in ds.split)
    if ds.state == "on":
        return (f"Dual-Sage: on, heads {split} (root gpu:{plan.root_device} first), "
                f"{ds.transport} transport, min_tokens {ds.min_tokens:,} -- {ds.reason}")
    if ds.state == "standby":
        return f"Dual-Sage: standby, heads {split}, {ds.transport} transport -- {ds.reason}"
    return f"Dual-Sage: off -- {ds.reason}"


def _decisions(plan: Plan) -> list[str]:
    ch, pf = plan.chunking, plan.prefetch
    lines = []
    if plan.parallel is not None:
        for name, p in plan.parallel.passes.items():
            tokens = (plan.pass1 if name == "pass1" else plan.pass2).tokens \
                + plan.request.text_tokens
            lines.append(f"{LABELS[name]} ({tokens:,} tokens): {MODE_WORDS[p.mode]}, "
                         f"{_r(p.step_time_s, 1):.1f} s/it "
                         f"({p.speedup:.2f}x the root alone) -- {p.reason}")
    lines.append(f"attention: {plan.attention.describe()}")
    lines.append(f"DiT blocks: {pf.resident_blocks} resident, {pf.streamed_blocks} streamed"
                 f" -- {pf.reason}")
    if plan.loader is not None:
        lines.append(f"loader: {plan.loader.describe()}")
    if plan.host is not None:
        lines.append(f"host RAM: {plan.host.describe()}")
    if ch.ffn_chunk or ch.qkv_chunk or ch.head_group:
        lines.append(f"chunking: FFN {ch.ffn_chunk} rows, QKV {ch.qkv_chunk} rows, "
                     f"{ch.head_group} heads per attention call -- {ch.reason}")
    else:
        lines.append(f"chunking: off -- {ch.reason}")
    lines.append(_dual_sage_words(plan))
    if plan.decode is not None:
        lines.append(f"video decode: {plan.decode.describe()}")
    by_gpu: dict[int, list[str]] = {}
    for name, index in plan.placement.items():
        by_gpu.setdefault(index, []).append(COMPONENT_WORDS[name])
    lines.append("placement: " + "; ".join(f"{', '.join(v)} on gpu:{k}"
                                           for k, v in sorted(by_gpu.items())))
    out = ["decisions:"]
    for line in lines:
        out += _wrap(line, "  ")
    return out


def _phases(plan: Plan) -> list[str]:
    out = ["memory per phase (peak GiB; weights + activations + workspace):"]
    for g in plan.gpus:
        parts = ", ".join(f"{phase} {mem.peak / GiB:.1f}" for phase, mem in g.phases.items())
        out += _wrap(f"gpu:{g.index}: {parts} (usable {g.usable_bytes / GiB:.1f})", "  ")
    return out


def render_report(plan: Plan) -> str:
    lines = _headline(plan)
    for g in plan.gpus:
        lines += _gpu_line(plan, g)
    lines += _decisions(plan)
    if plan.verdict.advice:
        lines += _wrap(plan.verdict.advice)
    if not plan.fits:
        lines.append("does not fit:")
        for problem in plan.problems:
            lines += _wrap(f"- {problem}", "  ")
        if len(plan.suggestions) > 1:
            lines.append("other changes that fit:")
            for s in plan.suggestions[1:]:
                lines += _wrap(f"- {s}", "  ")
    if plan.verdict.tight:
        lines += _wrap("tight (under 0.5 GiB beyond the reserve): "
                       + "; ".join(plan.verdict.tight))
    if plan.notes:
        lines.append("notes:")
        for n in plan.notes:
            lines += _wrap(f"- {n}", "  ")
    lines += _phases(plan)
    lines += _wrap("(times leave out model loading and the prompt's text encoding; rates and "
                   "their sources: planner/profiles.json; the latent upscale is an estimate, "
                   "the decode measured on an H200: docs/BENCHMARKS.md)")
    return "\n".join(lines)


def _r(x: float, digits: int = 2) -> float:
    return round(float(x), digits)


def plan_to_dict(plan: Plan) -> dict:
    r = plan.request
    job = plan.job_time
    return {
        "verdict": verdict_word(plan),
        "fits": plan.fits,
        "tight": list(plan.verdict.tight),
        "advice": plan.verdict.advice,
        "job_time_s": {"total": _r(job.total_s, 1), "pass1": _r(job.pass1_s, 1),
                       "pass2": _r(job.pass2_s, 1), "upscale": _r(job.upscale_s, 1),
                       "decode": _r(job.decode_s, 1)},
        "steps": {"pass1": job.pass1_steps, "pass2": job.pass2_steps},
        "cfg": {"pass1": r.pass1_cfg, "pass2": r.pass2_cfg},
        "tokens": plan.pass2.tokens,
        "tokens_pass1": plan.pass1.tokens,
        "text_tokens": r.text_tokens,
        "frames": plan.pass2.frames,
        "seconds": _r(plan.pass2.seconds, 3),
        "pass1": {"width": plan.pass1.width, "height": plan.pass1.height},
        "pass2": {"width": plan.pass2.width, "height": plan.pass2.height},
        "profile": plan.profile.name,
        "dit_dtype": r.dit_dtype,
        "attention": {"kernel": plan.attention.kernel, "requested": plan.attention.requested,
                      "quantized": plan.attention.quantized, "reason": plan.attention.reason},
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
                "usable_bytes": g.usable_bytes,
                "peak_bytes": g.peak_bytes,
                "peak_phase": g.peak_phase,
                "headroom_bytes": g.headroom_bytes,
                "phases": {k: {"weights": v.weights, "activations": v.activations,
                               "workspace": v.workspace, "peak": v.peak}
                           for k, v in g.phases.items()},
            }
            for g in plan.gpus
        ],
        "dual_sage": {"state": plan.dual_sage.state, "installed": plan.dual_sage.enabled,
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
        "host_ram": None if plan.host is None else {
            "needed_bytes": plan.host.needed_bytes, "available_bytes": plan.host.available_bytes,
            "source": plan.host.source, "fits": plan.host.fits, "parts": dict(plan.host.parts)},
        "loader": None if plan.loader is None else {
            "mode": plan.loader.mode, "reason": plan.loader.reason,
            "pinned_budget_bytes": plan.loader.pinned_budget_bytes,
            "pinned_budget_source": plan.loader.pinned_budget_source},
        "parallel": None if plan.parallel is None else {
            "requested": plan.parallel.requested, "transport": plan.parallel.transport,
            "row_weights": [_r(w, 3) for w in plan.parallel.row_weights],
            "head_split": list(plan.parallel.head_split),
            "passes": {n: {"mode": p.mode, "reason": p.reason, "speedup": _r(p.speedup, 3),
                           "step_time_s": _r(p.step_time_s, 1), "helper_weights": p.helper_weights,
                           "options_s": dict(p.options_s or {}),
                           "root_activation_bytes": p.root_activation_bytes,
                           "helper_activation_bytes": p.helper_activation_bytes,
                           "helper_weight_bytes": p.helper_weight_bytes}
                       for n, p in plan.parallel.passes.items()}},
        "decode": None if plan.decode is None else {
            "devices": list(plan.decode.devices),
            "windows": [list(w) for w in plan.decode.windows],
            "seconds": _r(plan.decode.seconds),
            "single_gpu_seconds": _r(plan.decode.single_seconds),
            "peak_bytes": {str(k): v for k, v in plan.decode.peak_bytes.items()},
            "make_room": plan.decode.make_room, "reason": plan.decode.reason},
        "step_time_s": {k: _r(v, 1) for k, v in plan.step_time_s.items()},
        "single_gpu_step_time_s": {k: _r(v, 1) for k, v in plan.single_gpu_step_time_s.items()},
        "notes": list(plan.notes),
        "problems": list(plan.problems),
        "suggestions": list(plan.suggestions),
    }
