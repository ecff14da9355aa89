"""The status text our nodes show: what is active, on which GPU, and the predicted peak.

Pure functions over the plan, the placement and the feature status lines that each
`apply_<feature>` records through the seam (`protocol.record_status`); the lines are read only
through the seam too (`protocol.status_lines`, live lines as they are now; `describe_line`).
A feature that is not active is named as such with its reason, never left out: a silent no-op
is the complaint this text exists to answer.
"""

from __future__ import annotations

from typing import Any

from ..comfy_seam import protocol
from .devices import GiB
from .placement import Placement

FEATURES = ("sequence", "dual_sage", "chunking", "prefetch", "attention")
# What the bundled workflows need from ComfyUI itself (ComfyUI#15224 brought the H3 nodes).
H3_NODES = ("MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo")
CORE_UPSCALE = "MiniMaxH3LatentUpscaleWithModel"


def comfyui_support_line(node_classes, passes: Any = None) -> str:
    """One status line: does this ComfyUI run the bundled workflows, and, when the graph has a
    latent upscale (`passes`, a `server.GraphPasses`), which one runs."""
    missing = [n for n in H3_NODES if n not in node_classes]
    upscale = ""
    if passes is not None and passes.upscale is not None:
        upscale = f"; latent upscale: {passes.upscale}"
    if missing:
        return (f"ComfyUI: NO MiniMax H3 nodes ({', '.join(missing)} missing): update ComfyUI "
                f"(ComfyUI#15224 or newer) to run H3{upscale}")
    return f"ComfyUI: MiniMax H3 nodes present{upscale}"


def feature_lines(model: Any) -> dict[str, str]:
    """{feature: status line} recorded on a patched model (empty when none)."""
    return protocol.status_lines(model)


def hooks_line(model: Any) -> str | None:
    """What the pack installed on a patched model, by whom, in which order (the seam's
    `describe`), or None for a model the pack did not patch."""
    if not protocol.is_patcher(model) or not protocol.installed(model):
        return None
    return protocol.describe_line(model)


def plan_is_for_this_server(plan: Any) -> bool:
    """A plan made with devices 'auto' (this server's GPUs), not for a built-in profile."""
    return getattr(getattr(plan, "profile", None), "name", None) == "auto"


def plan_words(plan: Any) -> str:
    """'plan for this server (fits)' or 'plan for profile 2xR9700 (2x ...), not this
    machine (fits)'."""
    fits = "fits" if getattr(plan, "fits", False) else "DOES NOT FIT"
    if plan_is_for_this_server(plan):
        return f"plan for this server ({fits})"
    profile = getattr(plan, "profile", None)
    name = getattr(profile, "name", "a profile")
    gpus = ", ".join(g.describe() for g in getattr(profile, "gpus", ()))
    return f"plan for profile {name} ({gpus}), not this machine ({fits})"


def peak_lines(plan: Any, placement: Placement) -> list[str]:
    """'predicted peak gpu:1 27.3 of 32.0 GiB (PASS2)' per GPU the placement uses; a plan for
    a profile names the profile's GPU, not this server's."""
    if plan is None:
        return ["predicted peak: no plan"]
    lines = []
    used = {placement.root, placement.helper} - {None}
    ours = plan_is_for_this_server(plan)
    whose = "" if ours else f"profile {getattr(plan.profile, 'name', 'unnamed')} "
    for gpu in getattr(plan, "gpus", []):
        if ours and used and gpu.index not in used:
            continue
        phases = getattr(gpu, "phases", {})
        worst = max(phases.items(), key=lambda kv: kv[1].peak, default=None)
        where = f" ({worst[0]})" if worst else ""
        lines.append(f"predicted peak {whose}gpu:{gpu.index} {gpu.peak_bytes / GiB:.1f} of "
                     f"{gpu.capacity_bytes / GiB:.1f} GiB{where}")
    return lines or ["predicted peak: the plan lists no GPU"]


def compose_status(
    *,
    placement: Placement,
    plan: Any = None,
    features: dict[str, str] | None = None,
    component_notes: list[str] | None = None,
    extra: list[str] | None = None,
    server: Any = None,
    inactive: str | None = None,
) -> str:
    """The multi-line status of the drop-in node. `server`: `server.ServerFacts` of this
    machine; `inactive`: why the node passed the models through unchanged."""
    if inactive is not None:
        head = (f"H3 Multi-GPU: NOT ACTIVE: {inactive}; the models pass through unchanged and "
                "ComfyUI runs them on its own defaults")
    else:
        gpus = len(placement.gpus)
        head = f"H3 Multi-GPU: active on {gpus} GPU{'s' if gpus != 1 else ''}"
    if plan is not None:
        head += f"; {plan_words(plan)}"
    facts = server.lines() if server is not None else []
    lines = []
    if inactive is None:
        lines += placement.lines()
    lines += peak_lines(plan, placement) if plan is not None or inactive is None else []
    if plan is not None and not getattr(plan, "fits", True):
        lines += [f"problem: {p}" for p in getattr(plan, "problems", [])]
    features = features or {}
    for name in FEATURES:
        if name in features:
            lines.append(f"{name}: {features[name]}")
    lines += [f"{name}: {text}" for name, text in features.items() if name not in FEATURES]
    lines += component_notes or []
    lines += [f"note: {n}" for n in placement.notes if inactive is None]
    lines += extra or []
    if server is not None:
        lines = [server.qualify(line) for line in lines]
    return "\n".join([head, *facts, *lines])
