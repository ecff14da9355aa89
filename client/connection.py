"""One server, one command: its URL, TLS, the command's deadline, single HTTP requests.

- `parse_server` validates --server (scheme, host, port 1-65535) and takes `user:password@` out
  of the URL into a Basic auth header, so no message, event or URL shown ever holds the password;
- `tls_context` trusts the system's CAs, a --ca-bundle, or nothing (--insecure);
- `Deadline` is the one --timeout of the whole command: every request's timeout and every
  backoff sleep is cut to what is left of it;
- `Transport.request` sends one request and sorts what can go wrong by what it means for a
  POST: `NotSent` (the server never got the whole request: safe to send again), `AnswerLost`
  (it was sent; the server may have acted on it), `HTTPStatus`, or a TLS error with its fix.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RunTimeout, ServerProtocolError, ServerUnavailable

MAX_JSON_BYTES = 512 << 20  # /object_info of a big install is tens of MB; a bound, not a guess
READ_CHUNK = 1 << 20
_PASSWORD = re.compile(r"(//[^/@:]*:)[^/@]*@")


def redact(url: str) -> str:
    """`url` with the password of `user:password@` replaced by ***."""
    return _PASSWORD.sub(r"\1***@", url)


@dataclass(frozen=True)
class ServerURL:
    base: str  # scheme://host[:port][/prefix], never with credentials
    scheme: str
    netloc: str  # host[:port]
    path: str  # the prefix a reverse proxy may add, without a trailing slash
    auth_header: str | None  # "Basic ..." when --server held user:password@


def parse_server(text: str) -> ServerURL:
    """Validate --server and split off its credentials; ValueError names the fix."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--server is empty; use e.g. http://127.0.0.1:8188")
    raw = text.strip()
    if "://" not in raw:
        raw = "http://" + raw
    shown = redact(raw)
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        reason = "a port outside 1-65535" if "port" in str(exc).lower() else "an invalid host"
        raise ValueError(f"server {shown!r} has {reason}; use e.g. http://127.0.0.1:8188 "
                         f"(ComfyUI's default port is 8188)") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"server {shown!r} is not an http(s) URL; use e.g. "
                         f"http://127.0.0.1:8188 or https://host")
    if not parts.hostname:
        raise ValueError(f"server {shown!r} names no host; use e.g. http://127.0.0.1:8188")
    if port == 0:
        raise ValueError(f"server {shown!r} has port 0; use 1-65535 (ComfyUI's default is "
                         f"8188)")
    if parts.query or parts.fragment:
        raise ValueError(f"server {shown!r} has a query or fragment; give only "
                         f"scheme://host:port, with the path prefix of a proxy if there is one")
    host = parts.hostname
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    auth = None
    if parts.username is not None or parts.password is not None:
        user = urllib.parse.unquote(parts.username or "")
        password = urllib.parse.unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    path = parts.path.rstrip("/")
    return ServerURL(f"{parts.scheme}://{netloc}{path}", parts.scheme, netloc, path, auth)


def tls_context(ca_bundle: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    """The TLS trust of every HTTPS and WSS connection."""
    if insecure and ca_bundle:
        raise ValueError("--insecure turns off the certificate check that --ca-bundle feeds; "
                         "pass only one of them")
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if ca_bundle:
        path = Path(ca_bundle)
        if not path.is_file():
            raise ValueError(f"--ca-bundle {ca_bundle!r} is not a file; give the PEM file of the "
                             f"server's certificate or of the CA that signed it")
        try:
            return ssl.create_default_context(cafile=str(path))
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ValueError(f"--ca-bundle {ca_bundle!r} holds no PEM certificate ({exc})"
                             ) from None
    return ssl.create_default_context()


def tls_error(base: str, exc: BaseException) -> ServerUnavailable:
    """A TLS failure, worded as what it is (not an outage) with the flags that fix it."""
    reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ServerUnavailable(
            f"the TLS certificate of {base} is not trusted ({reason}); pass --ca-bundle FILE "
            f"with the certificate (or CA) that signed it, or --insecure to skip the check")
    return ServerUnavailable(f"the TLS handshake with {base} failed ({reason}); is it an https "
                             f"server? For plain http use an http:// URL in --server")


class Deadline:
    """The one time limit of a command (None: no limit)."""

    def __init__(self, seconds: float | None = None):
        if seconds is not None and not (isinstance(seconds, (int, float))
                                        and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"--timeout {seconds!r} must be a positive number of seconds")
        self.total_s = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def check(self, doing: str) -> None:
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise RunTimeout(f"--timeout {self.total_s:g} s passed while {doing}")

    def cap(self, seconds: float, doing: str) -> float:
        """`seconds`, cut to what is left; RunTimeout when nothing is."""
        self.check(doing)
        remaining = self.remaining()
        return seconds if remaining is None else max(0.01, min(seconds, remaining))

    def sleep(self, seconds: float, doing: str) -> None:
        time.sleep(self.cap(seconds, doing))
        self.check(doing)


class NotSent(Exception):
    """The request did not reach the server whole (refused, DNS, connect timeout)."""


class AnswerLost(Exception):
    """The request was sent, but no complete answer came back: the server may have acted."""


_TAGS = re.compile(r"<(script|style)\b.*?</\1\s*>|<[^>]*>", re.IGNORECASE | re.DOTALL)
BODY_CHARS = 200  # of an error page shown in a message


class HTTPStatus(Exception):
    """An answer with a status that is not 2xx: its status, body and content type."""

    def __init__(self, status: int, body: bytes = b"", content_type: str = ""):
        self.status, self.body, self.content_type = status, body or b"", content_type or ""
        super().__init__(f"HTTP {status}")

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except (ValueError, RecursionError):
            return None

    def text(self, limit: int = BODY_CHARS) -> str:
        """The body as one line of text: an HTML page's words without its tags, trimmed."""
        text = self.body[: 1 << 16].decode("utf-8", "replace")
        if "html" in self.content_type.lower() or text.lstrip()[:1] == "<":
            text = _TAGS.sub(" ", text)
        text = " ".join(text.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def said(self) -> str:
        """' (text/html: "403 Forbidden nginx")' or '' for an empty body: for messages."""
        text = self.text()
        if not text:
            return ""
        kind = self.content_type.split(";")[0].strip() or "body"
        return f" ({kind}: {text!r})"


def describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {reason if reason is not None else exc}"


class Transport:
    """Single HTTP(S) requests to one server, credentials and TLS applied."""

    def __init__(self, server: ServerURL, context: ssl.SSLContext, deadline: Deadline):
        self.server = server
        self.context = context
        self.deadline = deadline
        self.opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))

    def open(self, method: str, path: str, body: Any = None, *, timeout: float):
        """The response object (a context manager), or raise NotSent/AnswerLost/HTTPStatus."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.server.auth_header:
            # unredirected: a redirect to another host never carries the password there
            request.add_unredirected_header("Authorization", self.server.auth_header)
        try:
            return self.opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read(1 << 16)
            except (OSError, http.client.HTTPException):
                raw = b""
            raise HTTPStatus(exc.code, raw, exc.headers.get("Content-Type", "")
                             if exc.headers is not None else "") from None
        except urllib.error.URLError as exc:  # raised while connecting or sending
            if isinstance(exc.reason, ssl.SSLError):
                raise tls_error(self.server.base, exc.reason) from None
            raise NotSent(describe(exc)) from None
        except ssl.SSLError as exc:
            raise AnswerLost(describe(exc)) from None
        except (OSError, http.client.HTTPException) as exc:  # sent; the answer did not come
            raise AnswerLost(describe(exc)) from None

    def request(self, method: str, path: str, body: Any = None, *, timeout: float,
                limit: int = MAX_JSON_BYTES) -> tuple[int, bytes, Any]:
        """(status, body, headers) of one request whose body is at most `limit` bytes."""
        response = self.open(method, path, body, timeout=timeout)
        chunks, size = [], 0
        # `timeout` bounds each silence; this bounds an answer that trickles in without end
        wall = time.monotonic() + max(60.0, 4 * timeout)
        try:
            with response:
                while True:
                    self.deadline.check(f"reading the answer of {method} {path}")
                    if time.monotonic() > wall:
                        raise AnswerLost(f"the answer of {method} {path} was still coming after "
                                         f"{max(60.0, 4 * timeout):.0f} s")
                    chunk = response.read(READ_CHUNK)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > limit:
                        raise ServerProtocolError(
                            f"{method} {path} at {self.server.base} answered more than "
                            f"{limit >> 20} MiB; that is not a ComfyUI API answer")
                    chunks.append(chunk)
        except (OSError, http.client.HTTPException) as exc:
            raise AnswerLost(describe(exc)) from None
        return response.status, b"".join(chunks), response.headers


def json_kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def decode_json(raw: bytes, headers: Any, what: str, base: str,
                expect: type | tuple[type, ...] | None = dict) -> Any:
    """The JSON of an answer, of the expected type; else a ServerProtocolError naming both."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        kind = headers.get_content_type() if hasattr(headers, "get_content_type") else "data"
        preview = raw[:60].decode("utf-8", "replace")
        raise ServerProtocolError(
            f"{what} at {base} answered {kind} that is not JSON ({preview!r}); is --server "
            f"a ComfyUI server, and not a login page or a proxy's error page?") from None
    if expect is not None and not isinstance(value, expect):
        types = expect if isinstance(expect, tuple) else (expect,)
        wanted = " or ".join(json_kind(t()) for t in types)
        raise ServerProtocolError(f"{what} at {base} answered a JSON {json_kind(value)} where "
                                  f"ComfyUI answers a JSON {wanted}; is --server a ComfyUI "
                                  f"server?")
    return value
