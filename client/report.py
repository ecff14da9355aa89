"""Human-readable server errors, and the two ways to show events: a text bar or JSON lines."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from .workflow import ApiPrompt, describe_node

MAX_VALUE_CHARS = 120
MAX_MESSAGE_CHARS = 2000


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def format_rejection(answer: dict, prompt: ApiPrompt,
                     headline: str = "the server refused the prompt") -> str:
    """A 400 from POST /prompt: the error, then each node's errors under its title.

    Tolerates any JSON shape: what cannot be read is shown as it came.
    """
    answer = answer if isinstance(answer, dict) else {}
    error = answer.get("error") or {}
    node_errors = answer.get("node_errors")
    node_errors = node_errors if isinstance(node_errors, dict) else {}
    if isinstance(error, dict):
        head = str(error.get("message") or error.get("type") or "prompt rejected")
        details = error.get("details")
        if details and not node_errors:
            head += f": {str(details)[:MAX_MESSAGE_CHARS]}"
    else:
        head = str(error)
    lines = [f"{headline}: {head}"]
    for node_id, node_error in node_errors.items():
        node_error = node_error if isinstance(node_error, dict) else {"errors": [node_error]}
        where = describe_node(prompt, str(node_id)) if str(node_id) in prompt else (
            f"node #{node_id} ({node_error.get('class_type', '?')})")
        lines.append(f"  {where}:")
        errors = node_error.get("errors")
        for item in errors if isinstance(errors, list) else [errors]:
            if not isinstance(item, dict):
                lines.append(f"    - {_short(item)}")
                continue
            message = item.get("message", "error")
            details = item.get("details")
            lines.append(f"    - {message}" + (f": {details}" if details else ""))
    return "\n".join(lines)


def format_execution_error(data: dict, prompt: ApiPrompt) -> str:
    """An `execution_error`: node id and title, exception, the node's inputs, traceback tail."""
    node_id = str(data.get("node_id"))
    message = str(data.get("exception_message", "")).strip()
    if len(message) > MAX_MESSAGE_CHARS:  # a node that put a whole tensor in its message
        message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message):,} characters)"
    lines = [
        f"{describe_node(prompt, node_id)} failed: "
        f"{str(data.get('exception_type', 'Exception'))[:MAX_VALUE_CHARS]}: {message}"
    ]
    inputs = (prompt.get(node_id) or {}).get("inputs") or {}
    values = {k: v for k, v in inputs.items() if not isinstance(v, list)}
    if values:
        lines.append("  inputs: " + ", ".join(f"{k}={_short(v)}" for k, v in values.items()))
    current = data.get("current_inputs")
    if isinstance(current, dict) and current:
        lines.append("  values seen by the node: "
                     + ", ".join(f"{k}={_short(v)}" for k, v in current.items()))
    traceback = data.get("traceback") or []
    if isinstance(traceback, str):  # one string instead of ComfyUI's list of lines
        traceback = traceback.splitlines()
    elif not isinstance(traceback, list):
        traceback = [str(traceback)]
    lines_tb = [line.rstrip() for item in traceback for line in str(item).splitlines()
                if line.strip()]
    if lines_tb:
        lines.append("  traceback (last lines):")
        lines += [f"    {line}" for line in lines_tb[-3:]]
    return "\n".join(lines)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class JsonReporter:
    """One JSON object per line on `stream` (stdout): the machine-readable event log."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: dict) -> None:
        self.stream.write(json.dumps({**event, "time": round(time.time(), 3)}) + "\n")
        self.stream.flush()


class TextReporter:
    """A progress bar per sampling node on stderr; plain lines for everything else.

    On a terminal the bar redraws in place; in a log file a line is written at most once a
    second per node (and always for the last step), so logs stay readable.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 24):
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.bar_open = False
        self.last_line: dict[str, float] = {}

    def _line(self, text: str) -> None:
        if self.bar_open:
            self.stream.write("\n")
            self.bar_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _bar(self, event: dict) -> None:
        value, total = event["value"], max(1, event["max"])
        filled = int(self.width * min(value, total) / total)
        text = (f"{event['title'][:28]:<28} [{'#' * filled}{'-' * (self.width - filled)}] "
                f"{value}/{event['max']}  elapsed {_clock(event['elapsed_s'])}  "
                f"ETA {_clock(event['eta_s'])}")
        if self.tty:
            self.stream.write("\r" + text)
            self.bar_open = True
            self.stream.flush()
            return
        now = time.monotonic()
        if value >= event["max"] or now - self.last_line.get(event["node"], 0.0) >= 1.0:
            self.last_line[event["node"]] = now
            self._line(text)

    def __call__(self, event: dict) -> None:
        kind = event["event"]
        if kind == "progress":
            self._bar(event)
        elif kind == "queued":
            self._line(f"queued prompt {event['prompt_id']}")
        elif kind == "executing":
            self._line(f"running {event['title']} (node #{event['node']})")
        elif kind == "retry":
            self._line(f"{event['what']}: {event['error']}; retry {event['attempt']}/"
                       f"{event['of']} in {event['wait_s']:.1f} s")
        elif kind == "ws_reconnect":
            self._line(f"WebSocket lost ({event['reason']}); reconnecting")
        elif kind == "reconciled":
            self._line(f"prompt {event['prompt_id']} found on the server: {event['found_in']}")
        elif kind == "cancelled":
            self._line(f"{event['why']}: prompt {event['prompt_id']} {event['action']}")
        elif kind == "validated":
            self._line(f"checked {event['nodes']} nodes against the server")
        elif kind == "started":
            self._line(f"prompt {event['prompt_id']} started")
        elif kind == "patched":
            self._line(f"set {event['change']}")
        elif kind == "history_wait":
            self._line("finished; waiting for the server to record the outputs")
        elif kind == "downloaded":
            self._line(f"saved {event['path']} ({event['bytes']} bytes)")
        elif kind == "skipped":
            self._line(f"skipped an output of node #{event['node']}: {event['reason']}")
        elif kind == "post_unanswered":
            self._line(f"{event['reason']}; not sending it again: looking for prompt "
                       f"{event['prompt_id']} in the server's queue and history")
        elif kind == "warning":
            self._line(f"warning: {event['message']}")
