"""ComfyClient: ComfyUI's HTTP and WebSocket API with retries, reconciliation and downloads.

Rules that keep a user's job safe:
- one `Deadline` bounds the whole command: every request's timeout and backoff is cut to it;
- GETs are retried on connection errors and 5xx with exponential backoff; a 4xx never is;
- POST /prompt is sent again only when the server surely did not queue it: the connection was
  refused (it never got the request), or it answered 5xx and the prompt is in neither /queue nor
  /history. When the request went out and its answer was lost or late, it is never sent again
  (a second POST could run the job twice): the client watches /queue and /history for it;
- the prompt carries our prompt_id and the same id in `extra_data`, so it is found even on a
  server that assigns its own ids; when the answer names another id, that one is followed;
- answers are checked for ComfyUI's shapes; anything else is a ServerProtocolError naming the
  endpoint and the server;
- downloads go to a new file under a sanitised name (never overwriting one), within a size
  limit and the deadline, and are checked against Content-Length.
"""

from __future__ import annotations

import http.client
import math
import ssl
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .connection import (
    AnswerLost,
    Deadline,
    HTTPStatus,
    NotSent,
    Transport,
    decode_json,
    describe,
    parse_server,
    tls_context,
    tls_error,
)
from .download import DEFAULT_MAX_DOWNLOAD_BYTES, exclusive_file, safe_file_name
from .errors import DownloadError, PromptRejected, ServerProtocolError, ServerUnavailable
from .schema_check import object_info_problem
from .ws import websocket_module

if TYPE_CHECKING:
    import websocket

EventSink = Callable[[dict], None]
REQUEST_KEY = "h3_multigpu_prompt_id"  # our prompt_id inside extra_data, found in /queue
RECENT_HISTORY = 64  # history entries searched for a prompt queued under the server's own id

__all__ = ["ComfyClient", "Deadline", "EventSink", "exclusive_file"]


class SkippedOutput(Exception):
    """An output that cannot be saved here (its name is not a file name)."""


def where_on_server(ref: dict) -> str:
    """'output folder, subfolder video': where ComfyUI keeps an output, in words."""
    kind = ref.get("type") if isinstance(ref.get("type"), str) else "output"
    sub = ref.get("subfolder")
    return f"{kind} folder" + (f", subfolder {sub!r:.80}" if sub else "")


class ComfyClient:
    """One ComfyUI server, seen by one client id.

    `retries` bounds every retried call; the delay doubles from `backoff_s` up to `max_backoff_s`.
    `timeout_s` bounds each GET (and each silence within a download); POST /prompt may take
    `post_timeout_s` (a loaded server validates big graphs slowly), and when it did not answer in
    time the client waits up to `settle_s` for the prompt to show up rather than re-sending it.
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
        ca_bundle: str | None = None,
        insecure: bool = False,
        post_timeout_s: float = 300.0,
        settle_s: float = 60.0,
        max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
        deadline: Deadline | None = None,
    ):
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise ValueError(f"--retries {retries!r} must be a whole number from 0 to 100")
        for name, value in (("timeout_s", timeout_s), ("post_timeout_s", post_timeout_s),
                            ("settle_s", settle_s), ("backoff_s", backoff_s),
                            ("max_backoff_s", max_backoff_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds >= 0")
        if not (isinstance(max_download_bytes, int) and max_download_bytes > 0):
            raise ValueError(f"max_download_bytes={max_download_bytes!r} must be > 0")
        self.server = parse_server(server)
        self.base_url = self.server.base  # never holds the password
        self.tls = tls_context(ca_bundle, insecure)
        self.deadline = deadline or Deadline(None)
        self.client_id = client_id or uuid.uuid4().hex
        self.timeout_s = timeout_s
        self.post_timeout_s = post_timeout_s
        self.settle_s = settle_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_download_bytes = max_download_bytes
        self.on_event = on_event or (lambda event: None)

    # -- plain requests -------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        # built per call: tests and _cancel swap `deadline`, and the opener is cheap
        return Transport(self.server, self.tls, self.deadline)

    def _request(self, method: str, path: str, body: Any = None, *,
                 timeout: float | None = None) -> tuple[int, bytes, Any]:
        timeout = self.deadline.cap(timeout or self.timeout_s, f"{method} {path}")
        return self.transport.request(method, path, body, timeout=timeout)

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)

    def _backoff(self, what: str, attempt: int, error: str) -> None:
        wait = self.delay(attempt)
        self.on_event({"event": "retry", "what": what, "attempt": attempt + 1,
                       "of": self.retries, "error": error, "wait_s": wait})
        self.deadline.sleep(wait, what)

    def _retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """Run an idempotent `call`, retrying connection errors, lost answers and 5xx."""
        last = said = ""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except HTTPStatus as exc:
                if exc.status < 500:
                    raise
                last, said = f"HTTP {exc.status}", exc.said()
            except (NotSent, AnswerLost) as exc:
                last, said = str(exc), ""
            if attempt == self.retries:
                break
            self._backoff(what, attempt, last)
        raise ServerUnavailable(f"{what} failed after {self.retries + 1} attempts ({last}{said}); "
                                f"is ComfyUI running at {self.base_url}? Start it or pass --server")

    def _status_error(self, what: str, exc: HTTPStatus) -> Exception:
        """A 4xx (or an unexpected status) as what it means for the user, with what the server
        said (an error page's text, trimmed) and what to do."""
        said, base = exc.said(), self.base_url
        login = "put the login in --server as https://USER:PASSWORD@host:port"
        if exc.status == 401:
            if self.server.auth_header:
                return ServerUnavailable(f"{what}: {base} refused the user and password given in "
                                         f"--server (HTTP 401){said}")
            return ServerUnavailable(f"{what}: {base} asks for a login (HTTP 401){said}; {login}")
        if exc.status == 403:
            return ServerUnavailable(
                f"{what}: {base} refused access (HTTP 403){said}. A login or a proxy in front of "
                f"ComfyUI? If it wants a user and password, {login}; a proxy that lets only "
                f"browsers (or only some paths, such as /ws) through must be told to let this "
                f"client through")
        if exc.status == 404:
            return ServerProtocolError(f"{what} is not found at {base} (HTTP 404){said}; is "
                                       f"--server a ComfyUI server (with the path prefix of its "
                                       f"proxy, if any)?")
        hint = {405: "--server may name another service on that port, not ComfyUI",
                413: "the request is larger than the server, or a proxy in front of it, takes: "
                     "raise its limit (nginx: client_max_body_size)",
                429: "the server or a proxy limits how often it may be asked: wait and run "
                     "again"}.get(exc.status, "see the server's log (or its proxy's)")
        return ServerProtocolError(f"{what} at {base} answered HTTP {exc.status}{said}; {hint}")

    def get_json(self, path: str, expect: type | tuple[type, ...] | None = dict) -> Any:
        what = f"GET {path}"
        try:
            _, raw, headers = self._retrying(what, lambda: self._request("GET", path))
        except HTTPStatus as exc:
            raise self._status_error(what, exc) from None
        return decode_json(raw, headers, what, self.base_url, expect)

    def post_json(self, path: str, body: Any) -> int:
        """POST an idempotent request (interrupt, queue delete); return the HTTP status."""
        try:
            return self._retrying(f"POST {path}", lambda: self._request("POST", path, body)[0])
        except HTTPStatus as exc:
            return exc.status

    # -- the API --------------------------------------------------------------------------

    def object_info(self) -> dict:
        """Every node class the server has, checked for the shapes the graph checks read."""
        info = self.get_json("/object_info")
        problem = object_info_problem(info)
        if problem:
            raise ServerProtocolError(
                f"GET /object_info at {self.base_url}: {problem}, not as ComfyUI describes node "
                f"classes; is --server a ComfyUI server? (A custom node pack that describes its "
                f"inputs oddly does this too: the server log names the pack)")
        return info

    def system_stats(self) -> dict:
        return self.get_json("/system_stats")

    def queue(self) -> dict:
        return self.get_json("/queue")

    def queue_entries(self) -> list[tuple[str, str, dict]]:
        """(state, prompt_id, extra_data) of every queued prompt, checked for /queue's shape."""
        answer, entries = self.queue(), []
        for state, key in (("running", "queue_running"), ("pending", "queue_pending")):
            items = answer.get(key, [])
            if not isinstance(items, list):
                raise ServerProtocolError(f"GET /queue at {self.base_url}: '{key}' is not a list "
                                          f"({items!r:.60}); is --server a ComfyUI server?")
            for item in items:
                if not (isinstance(item, list) and len(item) > 1 and isinstance(item[1], str)):
                    raise ServerProtocolError(
                        f"GET /queue at {self.base_url}: an entry of '{key}' is {item!r:.60}, not "
                        f"[number, prompt_id, prompt, extra_data, outputs]")
                extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
                entries.append((state, item[1], extra))
        return entries

    def history(self, prompt_id: str) -> dict | None:
        """The history entry of `prompt_id`, or None while it has none."""
        path = f"/history/{urllib.parse.quote(prompt_id, safe='')}"
        entry = self.get_json(path).get(prompt_id)
        if entry is not None and not isinstance(entry, dict):
            raise ServerProtocolError(f"GET {path} at {self.base_url}: the entry is "
                                      f"{entry!r:.60}, not an object")
        return entry

    def _recent_history_id(self, prompt_id: str) -> str | None:
        """The server's id of the history entry that carries our id in its extra_data."""
        recent = self.get_json(f"/history?max_items={RECENT_HISTORY}")
        for server_id, entry in recent.items():
            prompt = entry.get("prompt") if isinstance(entry, dict) else None
            extra = prompt[3] if isinstance(prompt, list) and len(prompt) > 3 else None
            if isinstance(extra, dict) and extra.get(REQUEST_KEY) == prompt_id:
                return str(server_id)
        return None

    def find(self, prompt_id: str, server_id: str | None = None) -> tuple[str, str] | None:
        """(where, the server's id) of our prompt: "running", "pending", "history"; or None.

        Matches our id, the id the server answered, or our id in the entry's extra_data (a
        server that assigns its own ids keeps extra_data as sent).
        """
        ids = {prompt_id, server_id} - {None}
        for state, queued_id, extra in self.queue_entries():
            if queued_id in ids or extra.get(REQUEST_KEY) == prompt_id:
                return state, queued_id
        for known in ids:
            if self.history(known) is not None:
                return "history", known
        found = self._recent_history_id(prompt_id)
        return None if found is None else ("history", found)

    def locate(self, prompt_id: str) -> str | None:
        """Where the server holds `prompt_id`: "running", "pending", "history" or None."""
        found = self.find(prompt_id)
        return None if found is None else found[0]

    def post_prompt(self, prompt: dict, prompt_id: str, extra_data: dict | None = None) -> dict:
        """Queue `prompt` under `prompt_id` at most once; return the server's answer.

        The answer's `prompt_id` is the server's (it may differ from ours). Raises PromptRejected
        on HTTP 400 (with the node_errors formatted by the caller).
        """
        what = "POST /prompt"
        body = {"prompt": prompt, "client_id": self.client_id, "prompt_id": prompt_id,
                "extra_data": {**(extra_data or {}), REQUEST_KEY: prompt_id}}
        last = said = ""
        for attempt in range(self.retries + 1):
            try:
                _, raw, headers = self._request("POST", "/prompt", body,
                                                timeout=self.post_timeout_s)
            except NotSent as exc:  # it never reached the server: sending again is safe
                last, said = str(exc), ""
            except AnswerLost as exc:
                return self._await_queued(prompt_id, f"{what} got no answer ({exc})")
            except HTTPStatus as exc:
                if exc.status == 400:
                    raise self._rejection(exc) from None
                if exc.status == 504:  # a gateway gave up waiting: ComfyUI may still queue it
                    return self._await_queued(prompt_id, f"{what} answered HTTP {exc.status}")
                if exc.status < 500:  # answered, and refused: nothing was queued
                    error = self._status_error(what, exc)
                    refused = type(error)(f"{error}; nothing was queued")
                    refused.not_queued = True  # the caller has nothing to cancel
                    raise refused from None
                last, said = f"HTTP {exc.status}", exc.said()
                # a 5xx may come after the prompt was queued: look before sending it again
                found = self.find(prompt_id)
                if found is not None:
                    return self._reconciled(prompt_id, found)
            else:
                return self._checked_answer(raw, headers, prompt_id)
            if attempt == self.retries:
                break
            self._backoff(what, attempt, last)
        raise ServerUnavailable(f"{what} failed after {self.retries + 1} attempts ({last}{said}); "
                                f"nothing was queued. Is ComfyUI running at {self.base_url}?")

    def _rejection(self, exc: HTTPStatus) -> PromptRejected:
        """A 400: ComfyUI's JSON of node errors, or an answer that is not (a proxy's page)."""
        answer = exc.json()
        if isinstance(answer, dict) and ("error" in answer or "node_errors" in answer):
            return PromptRejected("the server refused the prompt (HTTP 400)", answer)
        said = exc.said() or " with an empty body"
        return PromptRejected(
            f"the server refused the prompt: POST /prompt at {self.base_url} answered HTTP 400"
            f"{said}, which is not ComfyUI's answer (a JSON list of node errors). A proxy in "
            f"front of ComfyUI may have refused the request (too large, a login, a blocked "
            f"path), or --server is not ComfyUI: see that server's log", {})

    def _checked_answer(self, raw: bytes, headers: Any, prompt_id: str) -> dict:
        answer = decode_json(raw, headers, "POST /prompt", self.base_url, dict)
        their = answer.get("prompt_id")
        if not isinstance(their, str) or not their:
            raise ServerProtocolError(f"POST /prompt at {self.base_url} answered without a "
                                      f"prompt_id ({answer!r:.80}); is --server a ComfyUI "
                                      f"server?")
        if not isinstance(answer.get("node_errors"), dict):
            answer["node_errors"] = {}
        if their != prompt_id:
            self.on_event({"event": "warning", "message": f"the server queued the prompt as "
                           f"{their} (it ignores the client's id {prompt_id}); following {their}"})
        return answer

    def _reconciled(self, prompt_id: str, found: tuple[str, str]) -> dict:
        where, server_id = found
        self.on_event({"event": "reconciled", "prompt_id": server_id, "found_in": where})
        return {"prompt_id": server_id, "number": None, "node_errors": {}, "reconciled": where}

    def _await_queued(self, prompt_id: str, reason: str) -> dict:
        """The POST went out but its answer did not come back: find the prompt, never re-send."""
        self.on_event({"event": "post_unanswered", "prompt_id": prompt_id, "reason": reason})
        limit = time.monotonic() + self.settle_s
        delay = 0.1
        while True:
            found = self.find(prompt_id)
            if found is not None:
                return self._reconciled(prompt_id, found)
            left = limit - time.monotonic()
            if left <= 0:
                raise ServerUnavailable(
                    f"{reason}, and prompt {prompt_id} has not appeared in the queue or history "
                    f"of {self.base_url} within {self.settle_s:g} s. It was not sent again (that "
                    f"could run it twice). If it shows up later, it was queued after all: see "
                    f"{self.base_url}/history/{prompt_id} or remove it from the ComfyUI queue")
            self.deadline.sleep(min(delay, left), f"waiting for prompt {prompt_id} to appear")
            delay = min(2.0, delay * 2)

    def interrupt(self, prompt_id: str) -> int:
        # Servers that know `prompt_id` interrupt only that prompt; the caller checks that the
        # prompt is the running one first, so an older server's global interrupt hits it too.
        return self.post_json("/interrupt", {"prompt_id": prompt_id})

    def dequeue(self, prompt_id: str) -> int:
        return self.post_json("/queue", {"delete": [prompt_id]})

    def ws_url(self) -> str:
        scheme = "wss" if self.server.scheme == "https" else "ws"
        query = "/ws?clientId=" + urllib.parse.quote(self.client_id)
        return f"{scheme}://{self.server.netloc}{self.server.path}{query}"

    def open_ws(self, recv_timeout_s: float = 0.5) -> websocket.WebSocket:
        """Connect the WebSocket under our client id (retrying like HTTP)."""
        websocket = websocket_module()
        header = [f"Authorization: {self.server.auth_header}"] if self.server.auth_header else None
        sslopt = {"context": self.tls} if self.server.scheme == "https" else None

        def call():
            timeout = self.deadline.cap(self.timeout_s, "connecting the WebSocket")
            try:
                # No Origin header: it is a browser's; ComfyUI answers 403 when it does not
                # match the Host (a proxy or tunnel that rewrites Host), and a script is no
                # cross-site page
                ws = websocket.create_connection(self.ws_url(), timeout=timeout, header=header,
                                                 sslopt=sslopt, suppress_origin=True)
            except websocket.WebSocketBadStatusException as exc:
                headers = exc.resp_headers or {}
                raise HTTPStatus(exc.status_code, exc.resp_body or b"",
                                 headers.get("content-type", "")) from None
            except ssl.SSLError as exc:
                raise tls_error(self.base_url, exc) from None
            except (websocket.WebSocketException, OSError) as exc:
                raise NotSent(describe(exc)) from None
            ws.settimeout(recv_timeout_s)
            return ws

        try:
            return self._retrying("WebSocket /ws", call)
        except HTTPStatus as exc:
            raise self._status_error("WebSocket /ws", exc) from None

    # -- downloads ------------------------------------------------------------------------

    @staticmethod
    def view_path(ref: dict) -> str:
        query = urllib.parse.urlencode({"filename": str(ref.get("filename")),
                                        "subfolder": str(ref.get("subfolder") or ""),
                                        "type": str(ref.get("type") or "output")})
        return f"/view?{query}"

    def view_url(self, ref: dict) -> str:
        return self.base_url + self.view_path(ref)

    def download(self, ref: dict, out_dir: Path) -> Path:
        """Download one output into `out_dir` under a name no existing file has; return it.

        Raises SkippedOutput (its name cannot be a file name), DownloadError (after retries,
        or at once when it is over the size limit), RunTimeout (the deadline).
        """
        name, why = safe_file_name(ref.get("filename"))
        if name is None:
            raise SkippedOutput(f"{why}; it stays on the server: {self.view_url(ref)} (in its "
                                f"{where_on_server(ref)})")
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return self._download_once(ref, name, out_dir)
            except HTTPStatus as exc:
                if exc.status < 500:
                    raise DownloadError(f"{self.view_url(ref)} answered HTTP {exc.status}"
                                        f"{exc.said()}; the file is still on the server (in "
                                        f"its {where_on_server(ref)})") from None
                last = f"HTTP {exc.status}"
            except (NotSent, AnswerLost) as exc:
                last = str(exc)
            if attempt < self.retries:
                self._backoff(f"download {name}", attempt, last)
        raise DownloadError(f"could not download {name} ({last}); it is still on the server: "
                            f"{self.view_url(ref)}")

    def _download_once(self, ref: dict, name: str, out_dir: Path) -> Path:
        doing = f"downloading {name}"
        limit = self.max_download_bytes
        response = self.transport.open("GET", self.view_path(ref),
                                        timeout=self.deadline.cap(self.timeout_s, doing))
        with response:
            try:
                expected = int(response.headers.get("Content-Length"))
            except (TypeError, ValueError):
                expected = None
            if response.headers.get_content_type() == "text/html" and not name.lower().endswith(
                    (".html", ".htm")):
                page = HTTPStatus(response.status, response.read(1 << 16), "text/html")
                raise DownloadError(f"{self.view_url(ref)} answered an HTML page{page.said()} "
                                    f"instead of {name}: a login or a proxy's error page? The "
                                    f"file is still on the server (in its {where_on_server(ref)})")
            if expected is not None and expected > limit:
                raise DownloadError(f"{name} is {expected:,} bytes, over the download limit of "
                                    f"{limit:,} (raise it with --max-download); it is still on "
                                    f"the server: {self.view_url(ref)}")
            path, handle = exclusive_file(out_dir, name)
            written = 0
            try:
                with handle:
                    while True:
                        self.deadline.check(doing)
                        try:
                            chunk = response.read(1 << 20)
                        except (OSError, http.client.HTTPException) as exc:
                            raise AnswerLost(describe(exc)) from None
                        if not chunk:
                            break
                        written += len(chunk)
                        if written > limit:
                            raise DownloadError(
                                f"{name} sent more than the download limit of {limit:,} bytes "
                                f"and was stopped (raise it with --max-download); it is on the "
                                f"server: {self.view_url(ref)}")
                        handle.write(chunk)
                if expected is not None and written != expected:
                    raise AnswerLost(f"{name}: got {written} of {expected} bytes")
            except BaseException:
                path.unlink(missing_ok=True)  # never leave a truncated video behind
                raise
        return path
