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

import os
from pathlib import Path
from typing import Any

from .errors import (
    ClientError,
    ExecutionFailed,
    ExecutionInterrupted,
    PromptRejected,
    RunTimeout,
    ServerProtocolError,
    ServerUnavailable,
    Terminated,
    WorkflowError,
)
from .follow import Follower
from .http import ComfyClient, Deadline
from .outputs import download_all
from .params import Target
from .prepare import prepare
from .report import format_execution_error, format_rejection
from .session import EventSink
from .workflow import describe_node


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


class _Run(Follower):
    """Queue the prompt once, follow it, and cancel it when the user or the deadline stops."""

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

    def download_all(self, entry: dict, out_dir: Path) -> list[Path]:
        return download_all(self.client, self.prompt_id, self.emit, self.t0, entry, out_dir)


def _ok(status: int) -> bool:
    return 200 <= status < 300
