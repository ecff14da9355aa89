"""submit(): check a workflow, queue it once, follow it, fetch every output, cancel on Ctrl-C.

Order of steps and why:
1. /object_info first: UI workflows need it to be converted, and checking class types, inputs,
   model files and H3 geometry before the POST saves a failed 20 GB model load;
2. the WebSocket opens before the POST, so no message of a fast prompt is missed;
3. the prompt carries our own prompt_id, so a lost POST response is reconciled, not re-sent;
4. completion is read from the WebSocket, and from /history when the socket drops or stays
   silent; /history is then polled until it holds the outputs (execution_success can arrive
   before the server writes history);
5. every output is downloaded to a new file and checked; a failed download names the file on
   the server so a finished video is never lost;
6. Ctrl-C or --timeout after the POST cancels the prompt on the server (dequeue if pending,
   interrupt if running) and says which.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import websocket

from .errors import (
    DownloadError,
    ExecutionFailed,
    ExecutionInterrupted,
    PromptRejected,
    RunTimeout,
    ServerUnavailable,
    WorkflowError,
)
from .http import ComfyClient, EventSink
from .params import DEFAULT_TARGETS, Target, apply_params, check_pass_geometry
from .report import format_execution_error, format_rejection
from .validate import check_prompt
from .workflow import (
    ApiPrompt,
    describe_node,
    is_api_format,
    is_ui_format,
    load_workflow,
    node_title,
    ui_to_api,
)

FINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


def prepare(
    workflow: str | Path | dict,
    object_info: dict,
    params: dict[str, Any] | None = None,
    targets: dict[str, Target] | None = None,
    emit: EventSink = lambda event: None,
) -> ApiPrompt:
    """Workflow (API or UI) -> patched, checked API prompt; raise listing every problem."""
    data = load_workflow(workflow)
    if is_ui_format(data):
        prompt = ui_to_api(data, object_info)
        emit({"event": "converted", "nodes": len(prompt)})
    elif is_api_format(data):
        prompt = data
    else:
        raise WorkflowError([], "the file is neither an API workflow ({id: {class_type, inputs}}) "
                            "nor an editor workflow (nodes, links)")
    targets = {**DEFAULT_TARGETS, **(targets or {})}
    problems = []
    try:
        prompt, changes = apply_params(prompt, params or {}, targets)
        for change in changes:
            emit({"event": "patched", "change": change})
    except WorkflowError as exc:
        problems += exc.problems
    problems += check_pass_geometry(prompt, targets)
    problems += check_prompt(prompt, object_info)
    if problems:
        raise WorkflowError(problems)
    emit({"event": "validated", "nodes": len(prompt)})
    return prompt


def submit(
    workflow: str | Path | dict,
    *,
    server: str = "http://127.0.0.1:8188",
    params: dict[str, Any] | None = None,
    out_dir: str | Path = ".",
    on_event: EventSink | None = None,
    targets: dict[str, Target] | None = None,
    timeout_s: float | None = None,
    client: ComfyClient | None = None,
    poll_s: float = 5.0,
    history_timeout_s: float = 120.0,
) -> list[Path]:
    """Run `workflow` on the server and return the paths of its downloaded outputs.

    `params` keys: prompt, seconds, seed, steps, turbo, pass1_size, pass2_size ("WxH"), and any
    name given a target in `targets`. Raises WorkflowError, PromptRejected, ServerUnavailable,
    ExecutionFailed, ExecutionInterrupted, RunTimeout, DownloadError; re-raises
    KeyboardInterrupt after cancelling the prompt on the server.
    """
    emit = on_event or (lambda event: None)
    client = client or ComfyClient(server, on_event=emit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise WorkflowError([], f"--out {out} is not writable; pick another folder")
    prompt = prepare(workflow, client.object_info(), params, targets, emit)
    run = _Run(client, prompt, emit, timeout_s, poll_s, history_timeout_s)
    entry = run.execute()
    return run.download_all(entry, out)


class _Run:
    def __init__(self, client: ComfyClient, prompt: ApiPrompt, emit: EventSink,
                 timeout_s: float | None, poll_s: float, history_timeout_s: float):
        self.client, self.prompt, self.emit = client, prompt, emit
        self.prompt_id = str(uuid.uuid4())
        self.t0 = time.monotonic()
        self.deadline = None if not timeout_s else self.t0 + timeout_s
        self.poll_s, self.history_timeout_s = poll_s, history_timeout_s
        self.ws: websocket.WebSocket | None = None
        self.started_at: float | None = None
        self.node_started: dict[str, float] = {}
        self.final: dict | None = None  # the WebSocket message that ended the run

    # -- the run --------------------------------------------------------------------------

    def execute(self) -> dict:
        posted = False
        try:
            self.ws = self.client.open_ws()
            posted = True  # from here on the prompt may exist on the server
            answer = self.client.post_prompt(self.prompt, self.prompt_id)
            self.emit({"event": "queued", "prompt_id": self.prompt_id,
                       "number": answer.get("number"), "client_id": self.client.client_id})
            if answer.get("node_errors"):  # queued, but some outputs failed validation
                self.emit({"event": "warning", "message": format_rejection(
                    {"error": {"message": "they failed validation"}, **answer}, self.prompt,
                    "queued, but some outputs will not run")})
            if answer.get("reconciled") != "history":  # else it ran while we were retrying
                self._follow()
            entry = self._wait_history()
        except PromptRejected as exc:
            raise PromptRejected(format_rejection(exc.response, self.prompt), exc.response
                                 ) from None
        except ServerUnavailable as exc:
            if not posted:
                raise
            raise ServerUnavailable(
                f"{exc}\nprompt {self.prompt_id} may still be queued or running there; once the "
                f"server is back its outputs are listed at "
                f"{self.client.base_url}/history/{self.prompt_id}") from None
        except KeyboardInterrupt:
            if posted:
                self._cancel("Ctrl-C")
            raise
        except RunTimeout as exc:
            action = self._cancel("--timeout")
            raise RunTimeout(f"{exc}; the prompt was {action}") from None
        finally:
            if self.ws is not None:
                self.ws.close()
        self._raise_if_failed(entry)
        return entry

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RunTimeout(f"prompt {self.prompt_id} did not finish within --timeout "
                             f"{self.deadline - self.t0:.0f} s")

    def _follow(self) -> None:
        """Read WebSocket messages until our prompt ends; fall back to /history polling."""
        last_poll = time.monotonic()
        while True:
            self._check_deadline()
            try:
                raw = self.ws.recv()
                if not self.ws.connected:
                    raise websocket.WebSocketConnectionClosedException("closed by the server")
            except websocket.WebSocketTimeoutException:
                raw = None
            except (websocket.WebSocketException, ConnectionError, OSError) as exc:
                self._reconnect(exc)
                if self._finished_on_server():
                    return
                continue
            if isinstance(raw, str) and raw:
                if self._handle(json.loads(raw)):
                    return
            elif time.monotonic() - last_poll > self.poll_s:
                # A silent socket is normal during a long step, but also what a half-dead
                # connection looks like: ask /history now and then.
                last_poll = time.monotonic()
                if self.client.history(self.prompt_id) is not None:
                    return

    def _reconnect(self, exc: Exception) -> None:
        self.emit({"event": "ws_reconnect", "reason": str(exc) or type(exc).__name__})
        self.ws.close()
        self.ws = self.client.open_ws()  # same client id: the server resumes sending to us

    def _finished_on_server(self) -> bool:
        """After a reconnect: True when the prompt ended while we were away."""
        where = self.client.locate(self.prompt_id)
        self.emit({"event": "reconciled", "prompt_id": self.prompt_id, "found_in": where})
        if where is None:
            raise ExecutionFailed(f"prompt {self.prompt_id} is neither queued, running nor in "
                                  f"/history: the server was probably restarted; submit again")
        return where == "history"

    def _handle(self, message: dict) -> bool:
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "status":
            if self.started_at is None:
                remaining = ((data.get("status") or {}).get("exec_info") or {}).get(
                    "queue_remaining")
                self.emit({"event": "queue", "queue_remaining": remaining})
            return False
        if data.get("prompt_id") not in (None, self.prompt_id):
            return False  # another prompt's broadcast (e.g. its execution_interrupted)
        now = time.monotonic()
        if kind == "execution_start":
            self.started_at = now
            self.emit({"event": "started", "prompt_id": self.prompt_id})
        elif kind == "execution_cached":
            self.emit({"event": "cached", "nodes": data.get("nodes", [])})
        elif kind == "executing":
            node = data.get("node")
            if node is None:
                return data.get("prompt_id") == self.prompt_id
            self.node_started.setdefault(str(node), now)
            self.emit({"event": "executing", "node": str(node),
                       "title": node_title(self.prompt, str(node))})
        elif kind == "progress":
            self._progress(data, now)
        elif kind == "executed":
            files = [item.get("filename") for items in (data.get("output") or {}).values()
                     if isinstance(items, list) for item in items if isinstance(item, dict)]
            self.emit({"event": "executed", "node": str(data.get("node")),
                       "title": node_title(self.prompt, str(data.get("node"))), "files": files})
        elif kind in FINAL_EVENTS:
            self.final = message
            return True
        return False

    def _progress(self, data: dict, now: float) -> None:
        node = str(data.get("node"))
        value, total = int(data.get("value", 0)), int(data.get("max", 0))
        node_t0 = self.node_started.setdefault(node, now)
        eta = (now - node_t0) / value * (total - value) if value > 0 else None
        self.emit({"event": "progress", "node": node, "title": node_title(self.prompt, node),
                   "value": value, "max": total,
                   "elapsed_s": round(now - (self.started_at or self.t0), 1),
                   "eta_s": None if eta is None else round(eta, 1)})

    def _wait_history(self) -> dict:
        """Poll /history with a bounded backoff: the server may write it after telling us."""
        limit = time.monotonic() + self.history_timeout_s
        delay = 0.05
        waited = False
        while True:
            entry = self.client.history(self.prompt_id)
            if entry is not None:
                return entry
            if not waited:
                self.emit({"event": "history_wait", "prompt_id": self.prompt_id})
                waited = True
            self._check_deadline()
            if time.monotonic() > limit:
                raise ExecutionFailed(
                    f"prompt {self.prompt_id} finished but /history has no entry after "
                    f"{self.history_timeout_s:.0f} s; its outputs are in the server's output "
                    f"folder")
            time.sleep(delay)
            delay = min(2.0, delay * 2)

    def _raise_if_failed(self, entry: dict) -> None:
        status = entry.get("status") or {}
        final = self.final
        if final is None or final.get("type") == "execution_success":
            # The WebSocket missed the end (reconnect, polling): the history's messages tell.
            for event, data in status.get("messages") or []:
                if event in ("execution_error", "execution_interrupted"):
                    final = {"type": event, "data": data}
        if final is not None and final["type"] == "execution_error":
            raise ExecutionFailed(format_execution_error(final["data"], self.prompt),
                                  final["data"])
        if final is not None and final["type"] == "execution_interrupted":
            data = final["data"]
            raise ExecutionInterrupted(
                f"prompt {self.prompt_id} was interrupted on the server at "
                f"{describe_node(self.prompt, str(data.get('node_id')))}")
        if status.get("status_str") == "error":
            raise ExecutionFailed(f"prompt {self.prompt_id} ended with an error; see the "
                                  f"server log (history status: {status})")

    def _cancel(self, why: str) -> str:
        """Take our prompt off the server; return what was done, in words."""
        self.client.retries = min(self.client.retries, 2)  # a user waiting on Ctrl-C
        try:
            where = self.client.locate(self.prompt_id)
            if where == "pending":
                self.client.dequeue(self.prompt_id)
                action = "removed from the queue"
            elif where == "running":
                self.client.interrupt(self.prompt_id)
                action = "interrupted on the server"
            elif where == "history":
                action = "already finished; its outputs stay in the server's output folder"
            else:
                action = "not on the server (never queued)"
        except Exception as exc:  # report it; never let it mask the Ctrl-C itself
            action = (f"possibly still on the server ({type(exc).__name__}: {exc}); cancel "
                      f"prompt {self.prompt_id} from the ComfyUI queue")
        self.emit({"event": "cancelled", "why": why, "prompt_id": self.prompt_id,
                   "action": action})
        return action

    # -- outputs --------------------------------------------------------------------------

    def download_all(self, entry: dict, out_dir: Path) -> list[Path]:
        refs = output_files(entry)
        if not refs:
            self.emit({"event": "warning", "message": "the prompt produced no files"})
        paths, failures = [], []
        for ref in refs:
            try:
                path = self.client.download(ref, out_dir)
            except DownloadError as exc:
                failures.append(str(exc))
                continue
            except KeyboardInterrupt:
                left = [self.client.view_url(r) for r in refs[refs.index(ref):]]
                self.emit({"event": "cancelled", "why": "Ctrl-C", "prompt_id": self.prompt_id,
                           "action": "had finished; not downloaded yet: " + ", ".join(left)})
                raise
            paths.append(path)
            self.emit({"event": "downloaded", "path": str(path), "bytes": path.stat().st_size,
                       "filename": ref["filename"], "node": ref["node"]})
        if failures:
            saved = "".join(f"\n  saved: {p}" for p in paths)
            raise DownloadError("some outputs could not be downloaded:\n  "
                                + "\n  ".join(failures) + saved)
        self.emit({"event": "done", "prompt_id": self.prompt_id,
                   "paths": [str(p) for p in paths],
                   "elapsed_s": round(time.monotonic() - self.t0, 1)})
        return paths


def output_files(entry: dict) -> list[dict]:
    """Every file a history entry lists: images (videos have `animated`), gifs, videos, audio."""
    refs, seen = [], set()
    for node_id, output in (entry.get("outputs") or {}).items():
        for kind, items in (output or {}).items():
            if not isinstance(items, list):
                continue
            for item in items:
                if not isinstance(item, dict) or "filename" not in item:
                    continue
                key = (item.get("type", "output"), item.get("subfolder", ""), item["filename"])
                if key not in seen:
                    seen.add(key)
                    refs.append({**item, "node": str(node_id), "kind": kind})
    return refs
