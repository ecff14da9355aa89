"""Queueing a prompt at most once, and finding it again in /queue and /history.

POST /prompt is sent again only when the server surely did not queue it: the connection was
refused (it never got the request), or it answered 5xx and the prompt is in neither /queue nor
/history. When the request went out and its answer was lost or late, it is never sent again (a
second POST could run the job twice): the client watches /queue and /history for it. The prompt
carries our prompt_id and the same id in `extra_data`, so it is found even on a server that
assigns its own ids; when the answer names another id, that one is followed.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

from .connection import AnswerLost, HTTPStatus, NotSent, decode_json
from .errors import PromptRejected, ServerProtocolError, ServerUnavailable
from .session import ServerSession

REQUEST_KEY = "h3_multigpu_prompt_id"  # our prompt_id inside extra_data, found in /queue
RECENT_HISTORY = 64  # history entries searched for a prompt queued under the server's own id


class PromptQueue(ServerSession):
    """/queue, /history, POST /prompt, /interrupt: where our prompt is, and putting it there."""

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
