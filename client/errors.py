"""Errors raised by the submission client; each message names the value and the fix.

The CLI maps each class to an exit code (see `cli.py`), so scripts can tell a graph that will
never run (2) from a server that cannot be reached or used (3), a server that answered something
that is not ComfyUI's API (4), a run that failed on the server (1), a timeout (124), a Ctrl-C
(130) and a SIGTERM (143).
"""

from __future__ import annotations

from dataclasses import dataclass

SHOWN_CHARS = 80


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for a message, cut to `limit` characters (a 3000-digit seed or a pasted
    novel stays one readable line)."""
    if isinstance(value, int) and value.bit_length() > 4000:  # repr() refuses 4300+ digits
        return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ClientError(Exception):
    """Base class of every error the client raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a graph, found before anything is submitted."""

    where: str  # e.g. "node #12 'PASS2 Size' (EmptyMiniMaxH3LatentAV)" or "--seed"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class WorkflowError(ClientError, ValueError):
    """The workflow file or a parameter cannot be used; lists every problem at once.

    `source`: the workflow file the problems are in; the message starts with it, as a
    compiler's does, so a script that submits many files shows which one is wrong."""

    def __init__(self, problems: list[Problem], headline: str = "the workflow cannot be submitted",
                 source: str | None = None):
        self.problems = list(problems)
        self.headline = headline
        self.source = source
        head = headline if source is None else f"{source}: {headline}"
        lines = [f"{head} ({len(self.problems)} problem(s)):" if self.problems else head]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))

    def in_file(self, source: str | None) -> WorkflowError:
        """The same problems, the message naming `source` (kept when already named)."""
        if source is None or self.source is not None:
            return self
        return WorkflowError(self.problems, self.headline, source)


class ServerUnavailable(ClientError):
    """The server could not be reached, kept answering 5xx, refused the login or its TLS
    certificate is not trusted."""


class ServerProtocolError(ClientError):
    """The server answered, but not as ComfyUI does (not JSON, an HTML page, wrong shapes).

    The message names the endpoint and the server; it is the server's fault, not the graph's.
    """


class PromptRejected(ClientError):
    """POST /prompt answered 400: the server's own validation refused the graph."""

    def __init__(self, message: str, response: dict):
        self.response = response
        super().__init__(message)


class ExecutionFailed(ClientError):
    """The server ran the prompt and a node raised (`execution_error`)."""

    def __init__(self, message: str, details: dict | None = None):
        self.details = details or {}
        super().__init__(message)


class ExecutionInterrupted(ClientError):
    """The prompt was interrupted on the server (by this client or by someone else)."""


class RunTimeout(ClientError):
    """--timeout passed before the command finished; a queued prompt was cancelled."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, CI runners and service managers send): handled like Ctrl-C, so
    a queued prompt is cancelled, or its id printed with how to cancel it."""

    def __init__(self, signum: int = 15):
        self.signum = signum
        super().__init__(f"signal {signum}")


class DownloadError(ClientError):
    """An output could not be downloaded intact; the message lists the server-side files."""


class MissingPackage(ClientError, ImportError):
    """A package the command needs is not installed for the Python that runs it; the message
    names the package and the pip command for that Python."""
