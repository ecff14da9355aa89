"""Errors raised by the submission client; each message names the value and the fix.

The CLI maps each class to an exit code (see `cli.py`), so scripts can tell a graph that will
never run (2) from a server that is down (3), a run that failed on the server (1), a timeout
(124) and a Ctrl-C (130).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """The workflow file or a parameter cannot be used; lists every problem at once."""

    def __init__(self, problems: list[Problem], headline: str = "the workflow cannot be submitted"):
        self.problems = list(problems)
        lines = [f"{headline} ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class ServerUnavailable(ClientError):
    """The server could not be reached, or kept answering 5xx, after every retry."""


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
    """--timeout passed before the run finished; the prompt was cancelled on the server."""


class DownloadError(ClientError):
    """An output could not be downloaded intact; the message lists the server-side files."""
