"""Building a plan from node inputs (pure; the planner is imported when used)."""

from __future__ import annotations

from typing import Any


class PlannerUnavailable(RuntimeError):
    """The planner package is not importable in this install."""


def profiles() -> list[str]:
    """Hardware profile names the planner knows ([] when the planner is missing)."""
    try:
        from ..planner import list_profiles
    except ImportError:
        return []
    return list(list_profiles())


def make_plan(*, pass2_width: int, pass2_height: int, pass1_width: int, pass1_height: int,
              seconds: float, devices: str, lora_rank: int, parallel: str = "auto") -> Any:
    """plan_job for the two-pass job; ValueError for bad input, PlannerUnavailable if absent."""
    try:
        from ..planner import PlanRequest, plan_job
    except ImportError as exc:
        raise PlannerUnavailable(f"the planner is not importable ({exc})") from exc
    request = PlanRequest(width=pass2_width, height=pass2_height, seconds=seconds,
                          pass1_width=pass1_width, pass1_height=pass1_height,
                          profile=devices, lora_rank=lora_rank, parallel=parallel)
    return plan_job(request)
