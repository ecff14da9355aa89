"""ComfyClient: ComfyUI's HTTP and WebSocket API with retries, reconciliation and downloads.

Rules that keep a user's job safe:
- connection errors and 5xx are retried with exponential backoff; a 4xx never is (the same
  request would fail the same way, and a 400 on /prompt carries node_errors to show);
- POST /prompt sends our own prompt_id, and before any retry the client looks for that id in
  /queue and /history: a request whose response was lost may have been queued, and posting it
  again would run the job twice;
- downloads go to a new file (never overwriting one) and are checked against Content-Length.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websocket

from .errors import DownloadError, PromptRejected, ServerUnavailable

EventSink = Callable[[dict], None]
RETRYABLE_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                    socket.timeout, TimeoutError)


class _HTTPStatus(Exception):
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except json.JSONDecodeError:
            return None


class ComfyClient:
    """One ComfyUI server, seen by one client id.

    `retries` bounds every retried call; the delay doubles from `backoff_s` up to `max_backoff_s`.
    """

    def __init__(
        self,
        server: str = "http://127.0.0.1:8188",
        *,
        client_id: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        on_event: EventSink | None = None,
    ):
        if "://" not in server:
            server = "http://" + server
        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"server {server!r} is not an http(s) URL; use e.g. "
                             f"http://127.0.0.1:8188")
        self.base_url = server.rstrip("/")
        self.client_id = client_id or uuid.uuid4().hex
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_event = on_event or (lambda event: None)

    # -- plain requests -------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            raise _HTTPStatus(exc.code, exc.read()) from None

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)

    def _retrying(self, what: str, call: Callable[[], Any],
                  before_retry: Callable[[], Any] | None = None) -> Any:
        """Run `call`, retrying connection errors and 5xx; `before_retry` may end the loop by
        returning something other than None (used to reconcile a lost POST)."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except _HTTPStatus as exc:
                if exc.status < 500:
                    raise
                last = f"HTTP {exc.status}"
            except RETRYABLE_ERRORS as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if attempt == self.retries:
                break
            wait = self.delay(attempt)
            self.on_event({"event": "retry", "what": what, "attempt": attempt + 1,
                           "of": self.retries, "error": last, "wait_s": wait})
            time.sleep(wait)
            if before_retry is not None:
                found = before_retry()
                if found is not None:
                    return found
        raise ServerUnavailable(f"{what} failed after {self.retries + 1} attempts ({last}); is "
                                f"ComfyUI running at {self.base_url}? Start it or pass --server")

    def get_json(self, path: str) -> Any:
        def call():
            return json.loads(self._request("GET", path)[1] or b"null")

        try:
            return self._retrying(f"GET {path}", call)
        except _HTTPStatus as exc:
            raise ServerUnavailable(f"GET {path} answered HTTP {exc.status}") from None

    def post_json(self, path: str, body: Any) -> int:
        try:
            return self._retrying(f"POST {path}", lambda: self._request("POST", path, body)[0])
        except _HTTPStatus as exc:
            return exc.status

    # -- the API --------------------------------------------------------------------------

    def object_info(self) -> dict:
        return self.get_json("/object_info")

    def system_stats(self) -> dict:
        return self.get_json("/system_stats")

    def queue(self) -> dict:
        return self.get_json("/queue")

    def history(self, prompt_id: str) -> dict | None:
        """The history entry of `prompt_id`, or None while it has none."""
        return (self.get_json(f"/history/{urllib.parse.quote(prompt_id)}") or {}).get(prompt_id)

    def locate(self, prompt_id: str) -> str | None:
        """Where the server holds `prompt_id`: "running", "pending", "history" or None."""
        queue = self.queue()
        for state, key in (("running", "queue_running"), ("pending", "queue_pending")):
            if any(len(item) > 1 and item[1] == prompt_id for item in queue.get(key, [])):
                return state
        return "history" if self.history(prompt_id) is not None else None

    def post_prompt(self, prompt: dict, prompt_id: str, extra_data: dict | None = None) -> dict:
        """Queue `prompt` under `prompt_id` exactly once; return the server's answer.

        Raises PromptRejected on HTTP 400 (with the node_errors formatted by the caller).
        """
        body = {"prompt": prompt, "client_id": self.client_id, "prompt_id": prompt_id,
                "extra_data": extra_data or {}}

        def call():
            return json.loads(self._request("POST", "/prompt", body)[1])

        def reconcile():
            where = self.locate(prompt_id)
            if where is None:
                return None
            self.on_event({"event": "reconciled", "prompt_id": prompt_id, "found_in": where})
            return {"prompt_id": prompt_id, "number": None, "node_errors": {},
                    "reconciled": where}

        try:
            return self._retrying("POST /prompt", call, before_retry=reconcile)
        except _HTTPStatus as exc:
            answer = exc.json() if isinstance(exc.json(), dict) else {}
            raise PromptRejected(f"the server refused the prompt (HTTP {exc.status})",
                                 answer) from None

    def interrupt(self, prompt_id: str) -> int:
        # Servers that know `prompt_id` interrupt only that prompt; the caller checks that the
        # prompt is the running one first, so an older server's global interrupt hits it too.
        return self.post_json("/interrupt", {"prompt_id": prompt_id})

    def dequeue(self, prompt_id: str) -> int:
        return self.post_json("/queue", {"delete": [prompt_id]})

    def ws_url(self) -> str:
        parsed = urllib.parse.urlsplit(self.base_url)
        scheme = "wss" if parsed.scheme == "https" else "ws"
        path = parsed.path.rstrip("/") + "/ws?clientId=" + urllib.parse.quote(self.client_id)
        return f"{scheme}://{parsed.netloc}{path}"

    def open_ws(self, recv_timeout_s: float = 0.5) -> websocket.WebSocket:
        """Connect the WebSocket under our client id (retrying like HTTP)."""

        def call():
            try:
                ws = websocket.create_connection(self.ws_url(), timeout=self.timeout_s)
            except websocket.WebSocketBadStatusException as exc:
                raise _HTTPStatus(exc.status_code, b"") from None
            except websocket.WebSocketException as exc:
                raise ConnectionError(str(exc)) from None
            ws.settimeout(recv_timeout_s)
            return ws

        try:
            return self._retrying("WebSocket /ws", call)
        except _HTTPStatus as exc:
            raise ServerUnavailable(f"WebSocket /ws answered HTTP {exc.status}") from None

    # -- downloads ------------------------------------------------------------------------

    def view_url(self, ref: dict) -> str:
        query = urllib.parse.urlencode({"filename": ref["filename"],
                                        "subfolder": ref.get("subfolder", ""),
                                        "type": ref.get("type", "output")})
        return f"{self.base_url}/view?{query}"

    def download(self, ref: dict, out_dir: Path) -> Path:
        """Download one output into `out_dir` under a name no existing file has; return it."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return self._download_once(ref, out_dir)
            except _HTTPStatus as exc:
                if exc.status < 500:
                    raise DownloadError(f"{self.view_url(ref)} answered HTTP {exc.status}"
                                        ) from None
                last = f"HTTP {exc.status}"
            except (*RETRYABLE_ERRORS, DownloadError) as exc:
                last = str(exc)
            if attempt < self.retries:
                self.on_event({"event": "retry", "what": f"download {ref['filename']}",
                               "attempt": attempt + 1, "of": self.retries, "error": last,
                               "wait_s": self.delay(attempt)})
                time.sleep(self.delay(attempt))
        raise DownloadError(f"could not download {ref['filename']} ({last}); it is still on the "
                            f"server: {self.view_url(ref)}")

    def _download_once(self, ref: dict, out_dir: Path) -> Path:
        try:
            response = urllib.request.urlopen(self.view_url(ref), timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise _HTTPStatus(exc.code, b"") from None
        with response:
            expected = response.headers.get("Content-Length")
            path, handle = exclusive_file(out_dir, Path(ref["filename"]).name)
            written = 0
            try:
                with handle:
                    while chunk := response.read(1 << 20):
                        handle.write(chunk)
                        written += len(chunk)
                if expected is not None and written != int(expected):
                    raise DownloadError(f"{ref['filename']}: got {written} of {expected} bytes")
            except BaseException:
                path.unlink(missing_ok=True)  # never leave a truncated video behind
                raise
        return path


def exclusive_file(out_dir: Path, name: str, limit: int = 10_000):
    """Open a new file `name`, or `stem_1.ext`, `stem_2.ext`...; never an existing one.

    Opening with O_EXCL makes the check and the creation one step, so two runs writing to the
    same folder cannot pick the same name.
    """
    stem, suffix = os.path.splitext(name)
    for index in range(limit):
        candidate = out_dir / (name if index == 0 else f"{stem}_{index}{suffix}")
        try:
            return candidate, open(candidate, "xb")
        except FileExistsError:
            continue
    raise DownloadError(f"{out_dir} already holds {limit} files named like {name}; pick another "
                        f"--out folder")
