"""ComfyClient: ComfyUI's HTTP and WebSocket API with retries, reconciliation and downloads.

Its jobs, one module each: plain requests under one deadline with retries and the meaning of
each refusal (session.py), queueing a prompt at most once and finding it again (prompts.py),
downloading outputs safely (fetch.py); here the node classes the server has and the WebSocket.
Rules that keep a user's job safe are in each module's docstring.
"""

from __future__ import annotations

import ssl
import urllib.parse
from typing import TYPE_CHECKING

from .connection import Deadline, HTTPStatus, NotSent, describe, tls_error
from .download import exclusive_file
from .errors import ServerProtocolError
from .fetch import Downloads, SkippedOutput, where_on_server
from .prompts import PromptQueue
from .schema_check import object_info_problem
from .session import EventSink
from .ws import websocket_module

if TYPE_CHECKING:
    import websocket

__all__ = ["ComfyClient", "Deadline", "EventSink", "SkippedOutput", "exclusive_file",
           "where_on_server"]


class ComfyClient(PromptQueue, Downloads):
    """One ComfyUI server, seen by one client id: the keyword arguments (retries, timeouts,
    the login, the download limit, the deadline) are ServerSession's, in session.py."""

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
