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
6. Ctrl-C, SIGTERM, --timeout or a malformed answer after the POST cancels the prompt on the
   server (dequeue if pending, interrupt if running) and says truthfully what happened: a 403
   on the cancel is reported as "NOT removed", with the id and how to remove it.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import shape
from .errors import (
    ClientError,
    DownloadError,
    ExecutionFailed,
    ExecutionInterrupted,
    PromptRejected,
    RunTimeout,
    ServerProtocolError,
    ServerUnavailable,
    Terminated,
    WorkflowError,
)
from .http import ComfyClient, Deadline, EventSink, SkippedOutput
from .params import DEFAULT_TARGETS, Target, apply_params, check_pass_geometry
from .report import format_execution_error, format_rejection
from .validate import review_prompt
from .workflow import (
    ApiPrompt,
    describe_node,
    is_api_format,
    load_workflow,
    node_title,
    ui_to_api,
)
from .ws import websocket_module

if TYPE_CHECKING:
    import websocket

FINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


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
    cancel_grace_s: float = 10.0,
) -> list[Path]:
    """Run `workflow` on the server and return the paths of its downloaded outputs.

    `params` keys: prompt, seconds, seed, steps, turbo, pass1_size, pass2_size ("WxH"), and any
    name given a target in `targets`. `timeout_s` is one deadline for everything: checking,
    queueing, following and downloading (cancelling a queued prompt then takes at most
    `cancel_grace_s` more). Raises WorkflowError, PromptRejected, ServerUnavailable,
    ServerProtocolError, ExecutionFailed, ExecutionInterrupted, RunTimeout, DownloadError;
    re-raises KeyboardInterrupt (and Terminated) after cancelling the prompt on the server.
    """
    emit = on_event or (lambda event: None)
    client = client or ComfyClient(server, on_event=emit)
    if timeout_s is not None or client.deadline.total_s is None:
        client.deadline = Deadline(timeout_s)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkflowError([], f"--out {out} cannot be made a folder ({exc.strerror or exc}); "
                            f"pick another folder") from None
    if not os.access(out, os.W_OK):
        raise WorkflowError([], f"--out {out} is not writable; pick another folder")
    try:
        prompt = prepare(workflow, client.object_info(), params, targets, emit)
    except RunTimeout as exc:
        raise RunTimeout(f"{exc}; nothing was queued") from None
    run = _Run(client, prompt, emit, poll_s, history_timeout_s, cancel_grace_s)
    entry = run.execute()
    return run.download_all(entry, out)


class _Run:
    def __init__(self, client: ComfyClient, prompt: ApiPrompt, emit: EventSink, poll_s: float,
                 history_timeout_s: float, cancel_grace_s: float):
        self.client, self.prompt, self.emit = client, prompt, emit
        self.prompt_id = str(uuid.uuid4())  # ours; the server's answer may name another
        self.our_id = self.prompt_id
        self.t0 = time.monotonic()
        self.poll_s, self.history_timeout_s = poll_s, history_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.ws: websocket.WebSocket | None = None
        self.started_at: float | None = None
        self.node_started: dict[str, float] = {}
        self.final: dict | None = None  # the WebSocket message that ended the run
        self.malformed = 0  # WebSocket messages ignored for their shape
        self.post_answered = False  # False while POST /prompt may still be in flight

    # -- the run --------------------------------------------------------------------------

    def execute(self) -> dict:
        posted = False
        try:
            self.ws = self.client.open_ws()
            posted = True  # from here on the prompt may exist on the server
            answer = self.client.post_prompt(self.prompt, self.prompt_id)
            self.post_answered = True
            self.prompt_id = answer["prompt_id"]  # the server's id is the one to follow
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
            if not exc.response:  # not ComfyUI's node errors: the message says what came
                raise
            raise PromptRejected(format_rejection(exc.response, self.prompt), exc.response
                                 ) from None
        except ServerUnavailable as exc:
            if not posted or getattr(exc, "not_queued", False):
                raise
            raise ServerUnavailable(
                f"{exc}\nprompt {self.prompt_id} may still be queued or running there; once the "
                f"server is back its outputs are listed at "
                f"{self.client.base_url}/history/{self.prompt_id}") from None
        except KeyboardInterrupt as exc:
            if posted:
                self._cancel("SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C")
            raise
        except RunTimeout as exc:
            if not posted:
                raise RunTimeout(f"{exc}; nothing was queued") from None
            action = self._cancel("--timeout")
            raise RunTimeout(f"{exc}; prompt {self.prompt_id} was {action}") from None
        except ServerProtocolError as exc:
            if not posted or getattr(exc, "not_queued", False):
                raise
            action = self._cancel("a malformed answer")
            raise ServerProtocolError(f"{exc}\nprompt {self.prompt_id}: {action}") from None
        except ClientError:
            raise  # ExecutionFailed: the server says where the prompt stands
        except Exception:  # a bug here must not leave a queued prompt without its id
            if posted:
                self._cancel("an unexpected error")
            raise
        finally:
            if self.ws is not None:
                self.ws.close()
        self._raise_if_failed(entry)
        return entry

    def _check_deadline(self) -> None:
        self.client.deadline.check(f"following prompt {self.prompt_id}")

    def _follow(self) -> None:
        """Read WebSocket messages until our prompt ends; fall back to /history polling."""
        websocket = websocket_module()
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
                message = self._parse(raw)
                if message is not None and self._handle(message):
                    return
            elif time.monotonic() - last_poll > self.poll_s:
                # A silent socket is normal during a long step, but also what a half-dead
                # connection looks like: ask /history now and then.
                last_poll = time.monotonic()
                if self.client.history(self.prompt_id) is not None:
                    return

    def _parse(self, raw: str) -> dict | None:
        """A WebSocket message as {"type": str, "data": dict}, or None (warned about once)."""
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):
            message = None
        if (isinstance(message, dict) and isinstance(message.get("type"), str)
                and isinstance(message.get("data", {}), dict)):
            return message
        self.malformed += 1
        if self.malformed == 1:  # /history decides the outcome; the socket only shows progress
            self.emit({"event": "warning", "message": f"ignoring WebSocket messages from "
                       f"{self.client.base_url} that are not ComfyUI's ({raw[:60]!r})"})
        return None

    def _reconnect(self, exc: Exception) -> None:
        self.emit({"event": "ws_reconnect", "reason": str(exc) or type(exc).__name__})
        self.ws.close()
        self.ws = self.client.open_ws()  # same client id: the server resumes sending to us

    def _finished_on_server(self) -> bool:
        """After a reconnect: True when the prompt ended while we were away."""
        found = self.client.find(self.our_id, self.prompt_id)
        where = None if found is None else found[0]
        self.emit({"event": "reconciled", "prompt_id": self.prompt_id, "found_in": where})
        if where is None:
            raise ExecutionFailed(f"prompt {self.prompt_id} is neither queued, running nor in "
                                  f"/history: the server was probably restarted; submit again")
        return where == "history"

    def _handle(self, message: dict) -> bool:
        kind, data = message["type"], message.get("data") or {}
        if kind == "status":
            if self.started_at is None:
                status = data.get("status")
                exec_info = status.get("exec_info") if isinstance(status, dict) else None
                remaining = exec_info.get("queue_remaining") if isinstance(exec_info,
                                                                           dict) else None
                self.emit({"event": "queue", "queue_remaining": remaining})
            return False
        ours = data.get("prompt_id") == self.prompt_id
        if kind in FINAL_EVENTS:
            if ours:  # a broadcast without our id (or another prompt's) is not our end
                self.final = message
            return ours
        if data.get("prompt_id") not in (None, self.prompt_id):
            return False  # another prompt's message
        now = time.monotonic()
        if kind == "execution_start" and ours:
            self.started_at = now
            self.emit({"event": "started", "prompt_id": self.prompt_id})
        elif kind == "execution_cached":
            nodes = data.get("nodes")
            self.emit({"event": "cached", "nodes": nodes if isinstance(nodes, list) else []})
        elif kind == "executing":
            node = data.get("node")
            if node is None:
                return ours
            self.node_started.setdefault(str(node), now)
            self.emit({"event": "executing", "node": str(node),
                       "title": node_title(self.prompt, str(node))})
        elif kind == "progress":
            self._progress(data, now)
        elif kind == "executed":
            output = data.get("output")
            files = [item.get("filename") for items in
                     (output.values() if isinstance(output, dict) else [])
                     if isinstance(items, list) for item in items if isinstance(item, dict)]
            self.emit({"event": "executed", "node": str(data.get("node")),
                       "title": node_title(self.prompt, str(data.get("node"))), "files": files})
        return False

    def _progress(self, data: dict, now: float) -> None:
        value, total = _count(data.get("value")), _count(data.get("max"))
        if value is None or total is None:
            return  # a progress message we cannot read shows nothing rather than nonsense
        node = str(data.get("node"))
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
            self.client.deadline.sleep(delay, f"waiting for the history of {self.prompt_id}")
            delay = min(2.0, delay * 2)

    def _raise_if_failed(self, entry: dict) -> None:
        status = entry.get("status")
        status = status if isinstance(status, dict) else {}
        final = self.final
        if final is None or final.get("type") == "execution_success":
            # The WebSocket missed the end (reconnect, polling): the history's messages tell.
            messages = status.get("messages")
            for item in messages if isinstance(messages, list) else []:
                if (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
                        and item[0] in ("execution_error", "execution_interrupted")):
                    final = {"type": item[0], "data": item[1]}
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
                                  f"server log (history status: {status!r:.300})")

    def _cancel(self, why: str) -> str:
        """Take our prompt off the server; return what was done, in words (the truth)."""
        client = self.client
        saved = client.retries, client.deadline
        client.retries = min(client.retries, 1)  # a user waiting on Ctrl-C
        client.deadline = Deadline(self.cancel_grace_s)  # the command's own may be spent
        base, pid = client.base_url, self.prompt_id
        try:
            found = client.find(self.our_id, self.prompt_id)
            if found is None and self.post_answered:
                action = "not found in the server's queue or history (never queued)"
            elif found is None:
                action = (f"not in the server's queue or history yet, but its POST /prompt was "
                          f"never answered, so it may still appear: check {base}/queue and "
                          f"remove prompt {pid} if it is there")
            else:
                where, pid = found
                action = self._take_off(where, pid)
        except BaseException as exc:  # a dead server, a second Ctrl-C: never mask the first
            action = (f"possibly still on the server ({type(exc).__name__}: {exc}); cancel "
                      f"prompt {pid} from the ComfyUI queue at {base}")
        finally:
            client.retries, client.deadline = saved
        self.emit({"event": "cancelled", "why": why, "prompt_id": pid, "action": action})
        return action

    def _take_off(self, where: str, pid: str) -> str:
        client, base = self.client, self.client.base_url
        if where == "pending":
            status = client.dequeue(pid)
            if not _ok(status):
                return (f"NOT removed: POST /queue answered HTTP {status}; it is still queued at "
                        f"{base}: remove prompt {pid} from the ComfyUI queue")
            again = client.find(self.our_id, pid)
            if again is not None and again[0] == "pending":
                return (f"NOT removed: it is still queued at {base} after the delete; remove "
                        f"prompt {pid} from the ComfyUI queue")
            return "removed from the queue"
        if where == "running":
            status = client.interrupt(pid)
            if not _ok(status):
                return (f"NOT interrupted: POST /interrupt answered HTTP {status}; it is still "
                        f"running at {base}: stop prompt {pid} from the ComfyUI queue")
            return "interrupted on the server"
        return "already finished; its outputs stay in the server's output folder"

    # -- outputs --------------------------------------------------------------------------

    def download_all(self, entry: dict, out_dir: Path) -> list[Path]:
        try:
            refs = output_files(entry)
        except ServerProtocolError as exc:
            raise ServerProtocolError(
                f"{exc}\nprompt {self.prompt_id} had finished; its outputs stay in the server's "
                f"output folder") from None
        if not refs:
            self.emit({"event": "warning", "message": "the prompt produced no files"})
        paths, failures, skipped = [], [], []
        for index, ref in enumerate(refs):
            try:
                path = self.client.download(ref, out_dir)
            except SkippedOutput as exc:
                skipped.append(f"node #{ref['node']}: {exc}")
                self.emit({"event": "skipped", "node": ref["node"], "reason": str(exc)})
                continue
            except DownloadError as exc:
                failures.append(str(exc))
                continue
            except (KeyboardInterrupt, RunTimeout) as exc:
                left = [self.client.view_url(r) for r in refs[index:]]
                action = "had finished; not downloaded: " + ", ".join(left)
                if isinstance(exc, RunTimeout):
                    raise RunTimeout(f"{exc}; prompt {self.prompt_id} {action}") from None
                why = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
                self.emit({"event": "cancelled", "why": why, "prompt_id": self.prompt_id,
                           "action": action})
                raise
            paths.append(path)
            self.emit({"event": "downloaded", "path": str(path), "bytes": path.stat().st_size,
                       "filename": ref["filename"], "node": ref["node"]})
        if failures or skipped:
            saved = "".join(f"\n  saved: {p}" for p in paths)
            raise DownloadError("some outputs were not saved:\n  "
                                + "\n  ".join(failures + [f"skipped {s}" for s in skipped])
                                + saved)
        self.emit({"event": "done", "prompt_id": self.prompt_id,
                   "paths": [str(p) for p in paths],
                   "elapsed_s": round(time.monotonic() - self.t0, 1)})
        return paths


def _ok(status: int) -> bool:
    return 200 <= status < 300


def _count(value: Any) -> int | None:
    """A step count from a progress message: a finite number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


def output_files(entry: dict) -> list[dict]:
    """Every file a history entry lists: images (videos have `animated`), gifs, videos, audio.

    A ref's filename is as the server sent it (maybe not text); `download` decides whether it
    can be saved. An `outputs` that is not an object is the server's fault: ServerProtocolError.
    """
    outputs = entry.get("outputs") if isinstance(entry, dict) else None
    if outputs is None:
        return []
    if not isinstance(outputs, dict):
        raise ServerProtocolError(f"the history entry's 'outputs' is a "
                                  f"{type(outputs).__name__} ({outputs!r:.60}), not an object "
                                  f"of node ids; is --server a ComfyUI server?")
    refs, seen = [], set()
    for node_id, output in outputs.items():
        for kind, items in (output.items() if isinstance(output, dict) else ()):
            if not isinstance(items, list):
                continue
            for item in items:
                if not isinstance(item, dict) or "filename" not in item:
                    continue
                key = repr((item.get("type", "output"), item.get("subfolder", ""),
                            item["filename"]))
                if key not in seen:
                    seen.add(key)
                    refs.append({**item, "node": str(node_id), "kind": kind})
    return refs
