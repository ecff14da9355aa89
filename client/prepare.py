"""prepare(): a workflow file (API or editor format) -> the patched, checked API prompt.

Everything is checked before anything is queued, and every problem is reported at once: the
file's shape, the --set/--seconds/... patches, both passes' geometry, and the graph against the
server's /object_info (validate.py), so a wrong graph never starts a 20 GB model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import shape
from .errors import WorkflowError
from .params import DEFAULT_TARGETS, Target, apply_params, check_pass_geometry
from .session import EventSink
from .validate import review_prompt
from .workflow import ApiPrompt, is_api_format, load_workflow, ui_to_api


def prepare(
    workflow: str | Path | dict,
    object_info: dict,
    params: dict[str, Any] | None = None,
    targets: dict[str, Target] | None = None,
    emit: EventSink = lambda event: None,
) -> ApiPrompt:
    """Workflow (API or UI) -> patched, checked API prompt; raise listing every problem.

    Every WorkflowError names the workflow file (when it is one) before its problems."""
    source = None if isinstance(workflow, dict) else str(workflow)
    try:
        return _prepare(load_workflow(workflow), object_info, params, targets, emit)
    except WorkflowError as exc:
        raise exc.in_file(source) from None


def _read_graph(data: dict, object_info: dict, emit: EventSink) -> ApiPrompt:
    """The API graph of a loaded file: UI converted, API taken, either checked for its shape."""
    if "nodes" in data and not is_api_format(data):  # editor format (maybe broken)
        problems = shape.check_ui(data)
        if problems:
            raise WorkflowError(problems, shape.UI_HEADLINE)
        prompt = ui_to_api(data, object_info)
        emit({"event": "converted", "nodes": len(prompt)})
        if not prompt:
            raise WorkflowError([], "the editor workflow has no node that reaches the server "
                                    "(only notes, or every node muted or bypassed)")
        return prompt
    if not any(isinstance(node, dict) and "class_type" in node for node in data.values()):
        keys = ", ".join(repr(k) for k in list(data)[:5]) or "none"
        raise WorkflowError([], f"the file is neither an API workflow ({{id: {{class_type, "
                                f"inputs}}}}) nor an editor workflow (nodes, links); its keys: "
                                f"{keys}")
    return data


def _prepare(data: dict, object_info: dict, params: dict[str, Any] | None,
             targets: dict[str, Target] | None, emit: EventSink) -> ApiPrompt:
    prompt = _read_graph(data, object_info, emit)
    problems, notes = shape.check_api(prompt)
    if problems:
        raise WorkflowError(problems, shape.API_HEADLINE)
    targets = {**DEFAULT_TARGETS, **(targets or {})}
    try:
        prompt, changes = apply_params(prompt, params or {}, targets)
        for change in changes:
            emit({"event": "patched", "change": change})
    except WorkflowError as exc:
        problems += exc.problems
    problems += check_pass_geometry(prompt, targets)
    review = review_prompt(prompt, object_info)
    problems += review.problems
    if problems:
        raise WorkflowError(problems)
    for note in notes + review.notes:
        emit({"event": "warning", "message": str(note)})
    emit({"event": "validated", "nodes": len(prompt)})
    return prompt
