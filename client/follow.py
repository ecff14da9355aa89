"""Following one queued prompt: its WebSocket messages as events, /history as the truth.

The WebSocket opens before the POST (so no message of a fast prompt is missed) and only shows
progress; a dropped socket is reconnected under the same client id, a silent one makes /history
be asked now and then (a half-dead connection looks the same), and /history is polled until it
holds the outputs (execution_success can arrive before the server writes it).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from .errors import ExecutionFailed
from .http import ComfyClient
from .session import EventSink
from .workflow import ApiPrompt, node_title
from .ws import websocket_module

if TYPE_CHECKING:
    import websocket

FINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


class Follower:
    """One prompt's run as the client sees it; run.py's _Run adds queueing and cancelling."""

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


def _count(value: Any) -> int | None:
    """A step count from a progress message: a finite number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)
