"""Start a real ComfyUI on the CPU for `comfyui`-marked tests, with this pack installed.

    with start_comfyui(os.environ["COMFYUI_PATH"], PACK_ROOT, port=0) as url:
        ...  # e.g. ComfyClient(url).object_info()

The server runs from its checkout but with `--base-directory` set to a fresh temporary folder:
custom_nodes/ (holding a symlink to the pack), models/, input/, output/ and user/ live there and
the database is in memory, so a test run leaves nothing behind in the checkout and two
harnesses can run side by side. The interpreter is `python`, else $COMFYUI_PYTHON, else this
one. Startup is bounded by `startup_timeout_s`; on failure the error carries the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent
PACK_DIR_NAME = "comfyui-h3-multigpu"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with code {process.returncode} during startup; "
                               f"log {log}:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/system_stats", timeout=2) as response:
                json.load(response)
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            time.sleep(0.5)
    raise TimeoutError(f"ComfyUI did not answer /system_stats within {timeout_s:.0f} s; "
                       f"log {log}:\n{_log_tail(log)}")


@contextlib.contextmanager
def start_comfyui(
    comfyui_path: str | os.PathLike,
    pack_path: str | os.PathLike = PACK_ROOT,
    port: int = 0,
    python: str | None = None,
    *,
    startup_timeout_s: float = 180.0,
    extra_args: tuple[str, ...] = (),
    log_path: str | os.PathLike | None = None,
    custom_nodes: dict[str, str | os.PathLike] | None = None,
) -> Iterator[str]:
    """Run `python main.py --cpu --listen 127.0.0.1 --port N` and yield its base URL.

    `port=0` picks a free port. `log_path` keeps the server's output (default: inside the
    temporary base directory, removed at exit). `custom_nodes` (folder name -> path) installs
    more custom nodes beside the pack, e.g. a test-only one. The server is stopped (SIGTERM,
    then SIGKILL after 10 s) when the block exits, whatever happened inside it.
    """
    comfyui = Path(comfyui_path).resolve()
    if not (comfyui / "main.py").is_file():
        raise FileNotFoundError(f"{comfyui} has no main.py; set COMFYUI_PATH to a ComfyUI "
                                f"checkout")
    python = python or os.environ.get("COMFYUI_PYTHON") or sys.executable
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="h3-comfyui-") as base:
        extra_nodes, custom_nodes = custom_nodes, Path(base, "custom_nodes")
        custom_nodes.mkdir()
        (custom_nodes / PACK_DIR_NAME).symlink_to(Path(pack_path).resolve(),
                                                  target_is_directory=True)
        for folder, source in (extra_nodes or {}).items():
            (custom_nodes / folder).symlink_to(Path(source).resolve(), target_is_directory=True)
        log = Path(log_path) if log_path else Path(base, "comfyui.log")
        command = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                   "--base-directory", base, "--database-url", "sqlite:///:memory:",
                   "--disable-auto-launch", *extra_args]
        with open(log, "wb") as log_file:
            process = subprocess.Popen(command, cwd=comfyui, stdout=log_file,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                _wait_ready(url, process, log, startup_timeout_s)
                yield url
            finally:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
