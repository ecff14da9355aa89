"""websocket-client, imported where a run is followed (`submit` without --check) and nowhere
else: checking a workflow, the planner and the nodes run where it is not installed, and
`submit` says how to install it instead of vanishing from the command line."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from .errors import MissingPackage

DISTRIBUTION = "websocket-client"  # what pip installs; it provides the module `websocket`
# the pack's requirements file, beside the package in a git clone (a wheel has none)
REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"


def _quoted(path: str) -> str:
    # double quotes work in cmd.exe, PowerShell and POSIX shells alike
    return f'"{path}"' if " " in path else path


def missing_message() -> str:
    """One line: the missing package and the command that installs it for this Python."""
    python = _quoted(sys.executable or "python")
    fix = f"{python} -m pip install {DISTRIBUTION}"
    if REQUIREMENTS.is_file():
        fix += f" (or {python} -m pip install -r {_quoted(str(REQUIREMENTS))})"
    return (f"submitting needs the package {DISTRIBUTION} (--check does not), which this "
            f"Python lacks; install it with: {fix}")


def websocket_module() -> ModuleType:
    """The `websocket` module of websocket-client, or MissingPackage saying how to install it."""
    try:
        import websocket
    except ImportError as exc:
        raise MissingPackage(missing_message()) from exc
    return websocket
