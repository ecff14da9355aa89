"""ServerSession: one ComfyUI server's plain requests, under one deadline, with retries.

- one `Deadline` bounds the whole command: every request's timeout and backoff is cut to it;
- GETs are retried on connection errors and 5xx with exponential backoff; a 4xx never is;
- answers are checked for ComfyUI's shapes; anything else is a ServerProtocolError naming the
  endpoint and the server, and a 4xx says what it means for the user and what to do.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

from .connection import (
    AnswerLost,
    Deadline,
    HTTPStatus,
    NotSent,
    Transport,
    decode_json,
    parse_server,
    tls_context,
)
from .download import DEFAULT_MAX_DOWNLOAD_BYTES
from .errors import ServerProtocolError, ServerUnavailable

EventSink = Callable[[dict], None]


class ServerSession:
    """The server, the client id, and the limits every request of ComfyClient keeps.

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
