"""`h3-multigpu submit`: the command-line face of `submit()`.

Its parser and its run; the root `cli.py` owns the command line (`h3-multigpu`, `python -m
h3_multigpu`) and calls `add_submit_parser` and `run_submit`. The client sits below it, so it
has no entry of its own that would import the root back.

Exit codes: 0 done; 1 the run failed on the server, or an output could not be downloaded or
saved; 2 the workflow or a flag is wrong, the server's validation refused the prompt, or
websocket-client is not installed (only --check runs without it); 3 the server cannot be
reached or used (connection, 5xx after retries, login refused, TLS certificate not trusted); 4
the server answered something that is not ComfyUI's API; 70 an unexpected error in this client;
124 --timeout; 130 Ctrl-C; 143 SIGTERM. Whenever a prompt may be queued, its id and what was
done about it are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading

from .download import DEFAULT_MAX_DOWNLOAD_BYTES
from .download import parse_size as parse_bytes
from .errors import (
    DownloadError,
    ExecutionFailed,
    ExecutionInterrupted,
    MissingPackage,
    PromptRejected,
    RunTimeout,
    ServerProtocolError,
    ServerUnavailable,
    Terminated,
    WorkflowError,
)
from .http import ComfyClient, Deadline
from .params import parse_size, parse_target
from .report import JsonReporter, TextReporter
from .run import prepare, submit
from .ws import websocket_module

EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (MissingPackage, 2),
    (WorkflowError, 2),
    (PromptRejected, 2),
    (ServerUnavailable, 3),
    (ServerProtocolError, 4),
    (RunTimeout, 124),
    (ExecutionFailed, 1),
    (ExecutionInterrupted, 1),
    (DownloadError, 1),
)
EXIT_INTERNAL, EXIT_CTRL_C, EXIT_SIGTERM = 70, 130, 143


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds; use "
                                         f"e.g. --timeout 3600")
    return value


def _retries(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 100")
    return value


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_submit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit",
        help="submit a workflow to a ComfyUI server, follow it and download its outputs",
        description="Check WORKFLOW against the server, queue it once, show progress, download "
                    "every output to --out; Ctrl-C cancels the prompt on the server.",
    )
    p.add_argument("workflow", help="workflow JSON, API format or editor (UI) format")
    p.add_argument("--server", default="http://127.0.0.1:8188",
                   help="ComfyUI base URL; http://USER:PASSWORD@host:port for Basic auth "
                        "(the password is never printed)")
    p.add_argument("--prompt", help="text of the node titled 'Prompt'")
    p.add_argument("--seconds", type=float, help="duration, node titled 'Seconds' (5 = 124 f)")
    p.add_argument("--seed", type=int, help="seed, node titled 'Seed'")
    p.add_argument("--steps", type=int, help="steps, node 'Steps' (else 'PASS1 Steps')")
    p.add_argument("--pass1-steps", type=int, help="steps of PASS1, node 'PASS1 Steps'")
    p.add_argument("--pass2-steps", type=int, help="steps of PASS2, node 'PASS2 Steps'")
    p.add_argument("--pass1-size", type=_size, metavar="WxH",
                   help="nodes 'PASS1 Width'/'PASS1 Height', e.g. 864x480")
    p.add_argument("--pass2-size", type=_size, metavar="WxH",
                   help="nodes 'PASS2 Width'/'PASS2 Height', e.g. 1312x736")
    p.add_argument("--turbo", action=argparse.BooleanOptionalAction, default=None,
                   help="keep or bypass the node titled 'Turbo LoRA' (8-step LoRA)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any parameter given a target with --map (VALUE parsed as JSON if it can)")
    p.add_argument("--map", action="append", default=[], metavar="NAME=TITLE:INPUT",
                   help="where a parameter goes, e.g. seed='My Seed:noise_seed'")
    p.add_argument("--out", default=".", help="folder for the outputs (never overwritten)")
    p.add_argument("--json", action="store_true", help="one JSON event per line on stdout")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="seconds for the whole command: checking, queueing, running and "
                        "downloading; when it passes, a queued prompt is cancelled (default: "
                        "none)")
    p.add_argument("--retries", type=_retries, default=5,
                   help="retries on connection errors and 5xx, backoff 0.5 s doubling (default 5)")
    p.add_argument("--max-download", type=_bytes, default=DEFAULT_MAX_DOWNLOAD_BYTES,
                   metavar="SIZE",
                   help="largest output file to download, e.g. 2GiB (default 16GiB)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--ca-bundle", metavar="FILE",
                     help="PEM file of the certificate (or CA) an https server uses, e.g. a "
                          "self-signed one")
    tls.add_argument("--insecure", action="store_true",
                     help="https without checking the server's certificate (trusted networks "
                          "only)")
    p.add_argument("--check", action="store_true",
                   help="only check and patch the workflow; print the API prompt, submit nothing")
    p.set_defaults(func=run_submit)


def _params(args: argparse.Namespace) -> dict:
    params = {name: getattr(args, name) for name in
              ("prompt", "seconds", "seed", "steps", "pass1_steps", "pass2_steps", "pass1_size",
               "pass2_size", "turbo")}
    for item in args.set:
        name, sep, text = item.partition("=")
        if not sep:
            raise WorkflowError([], f"--set {item!r} is not NAME=VALUE")
        try:
            params[name.replace("-", "_")] = json.loads(text)
        except (ValueError, RecursionError):  # not JSON (or 4300+ digits, or endless nesting)
            params[name.replace("-", "_")] = text
    return params


@contextlib.contextmanager
def _sigterm_cancels():
    """While submitting, SIGTERM raises Terminated (handled like Ctrl-C: cancel, print id)."""
    sigterm = getattr(signal, "SIGTERM", None)
    if sigterm is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(sigterm, handler)
    try:
        yield
    finally:
        signal.signal(sigterm, previous)


def run_submit(args: argparse.Namespace) -> int:
    report = JsonReporter(sys.stdout) if args.json else TextReporter(sys.stderr)
    try:
        with _sigterm_cancels():
            if not args.check:  # refused before anything is read or sent: it cannot follow
                websocket_module()
            targets = dict(parse_target(item) for item in args.map)
            params = _params(args)
            client = ComfyClient(args.server, retries=args.retries, on_event=report,
                                 ca_bundle=args.ca_bundle, insecure=args.insecure,
                                 max_download_bytes=args.max_download,
                                 deadline=Deadline(args.timeout))
            if args.check:
                prompt = prepare(args.workflow, client.object_info(), params, targets, report)
                print(json.dumps(prompt, indent=2))
                return 0
            paths = submit(args.workflow, params=params, out_dir=args.out, on_event=report,
                           targets=targets, timeout_s=args.timeout, client=client)
    except Terminated:
        _fail(args, "interrupted", "stopped by SIGTERM")
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        _fail(args, "interrupted", "stopped by Ctrl-C")
        return EXIT_CTRL_C
    except tuple(cls for cls, _ in EXIT_CODES) as exc:
        _fail(args, "error", str(exc), type(exc).__name__)
        return next(code for cls, code in EXIT_CODES if isinstance(exc, cls))
    except ValueError as exc:  # --map syntax, a bad --server URL or --ca-bundle
        _fail(args, "error", str(exc), "ValueError")
        return 2
    except Exception as exc:  # a bug: a message, not a traceback (a queued prompt was cancelled)
        _fail(args, "error", f"unexpected error in the client ({type(exc).__name__}: {exc}); "
              f"please report it", type(exc).__name__)
        return EXIT_INTERNAL
    if not args.json:
        for path in paths:
            print(path)
    return 0


def _fail(args: argparse.Namespace, kind: str, message: str, error: str | None = None) -> None:
    if args.json:
        event = {"event": kind, "message": message}
        if error:
            event["error"] = error
        print(json.dumps(event), flush=True)
    else:
        print(f"h3-multigpu submit: {message}", file=sys.stderr)
