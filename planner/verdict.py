"""Stage 6 of a plan: the verdict, and what to change to fit or to go faster.

A job fits when every GPU keeps its reserve free in every phase; a phase with less than
`MIN_SPARE_BYTES` beyond the reserve still fits but is called tight (a misprediction of a few
percent would not). A plan always says one thing to change: the smallest change that fits, or
the largest speed-up in reach (another attention kernel, a second GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .attention import COMFY_FLAGS, KERNEL_WORDS
from .hardware import ATTENTION_KERNELS, GiB
from .modes import MIN_SPARE_BYTES
from .timing import duration

if TYPE_CHECKING:
    from .layout import GPUPlan
    from .plan import Plan


@dataclass(kw_only=True)
class Verdict:
    problems: list[str] = field(default_factory=list)  # phases over a GPU's usable memory
    tight: list[str] = field(default_factory=list)  # phases with less than the spare left
    suggestions: list[str] = field(default_factory=list)  # smallest changes that fit
    advice: str = ""  # "to fit: ..." or "to go faster: ..."

    @property
    def fits(self) -> bool:
        return not self.problems


def check_memory(gpus: list[GPUPlan]) -> Verdict:
    verdict = Verdict()
    for g in gpus:
        for phase, mem in g.phases.items():
            spare = g.usable_bytes - mem.peak
            if spare < 0:
                verdict.problems.append(
                    f"gpu:{g.index} {phase} needs {mem.peak / GiB:.1f} GiB of "
                    f"{g.usable_bytes / GiB:.1f} GiB usable")
            elif spare < MIN_SPARE_BYTES:
                verdict.tight.append(f"gpu:{g.index} {phase} has {spare / GiB:.1f} GiB to spare")
    return verdict


def advise(plan: Plan, suggest: bool) -> None:
    """Fill the plan's suggestions and its one line of advice."""
    verdict = plan.verdict
    if not verdict.fits:
        if suggest:
            from .suggest import suggest_fixes

            verdict.suggestions.extend(suggest_fixes(plan))
        first = verdict.suggestions[0] if verdict.suggestions else "a GPU with more memory"
        verdict.advice = f"to fit: {first}"
        return
    if suggest:
        verdict.advice = f"to go faster: {_faster(plan)}"


def _faster(plan: Plan) -> str:
    from .plan import plan_job

    request, current = plan.request, plan.attention.kernel
    root = plan.profile.gpus[plan.root_device]
    base = plan.job_time.total_s
    best: tuple[float, str] | None = None
    for kernel in ATTENTION_KERNELS:
        if kernel == current or kernel not in root.attention_rates:
            continue
        if root.attention_rates[kernel] <= root.attention_rate(current)[0]:
            continue
        other = plan_job(replace(request, attention=kernel, quantized_attention=False),
                         suggest=False)
        if other.fits and (best is None or other.job_time.total_s < best[0]):
            flag = COMFY_FLAGS[kernel]
            best = (other.job_time.total_s,
                    f"--attention {kernel} ({KERNEL_WORDS[kernel]}; in ComfyUI {flag}): job "
                    f"~{duration(other.job_time.total_s)} ({base / other.job_time.total_s:.2f}x)")
    if best is not None:
        return best[1]
    if plan.profile.gpu_count == 1:
        return ("a second GPU: the pack's sequence parallel splits every step (1.9x measured on "
                "two H200s)")
    return ("nothing in this plan's reach: fewer steps (--steps) or a shorter clip (attention "
            "grows with the square of the length)")
