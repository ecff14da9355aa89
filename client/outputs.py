"""The outputs of a finished prompt: which files its history lists, and saving each of them.

A failed or skipped download never loses a finished video: every file that was not saved is
named with where it stays on the server, after the others were saved.
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import DownloadError, RunTimeout, ServerProtocolError, Terminated
from .fetch import SkippedOutput
from .http import ComfyClient
from .session import EventSink


def download_all(client: ComfyClient, prompt_id: str, emit: EventSink, t0: float,
                 entry: dict, out_dir: Path) -> list[Path]:
    """Download every output of the history `entry` into `out_dir`; return their paths.

    `t0` is when the run began (for the `done` event's elapsed time)."""
    try:
        refs = output_files(entry)
    except ServerProtocolError as exc:
        raise ServerProtocolError(
            f"{exc}\nprompt {prompt_id} had finished; its outputs stay in the server's "
            f"output folder") from None
    if not refs:
        emit({"event": "warning", "message": "the prompt produced no files"})
    paths, failures, skipped = [], [], []
    for index, ref in enumerate(refs):
        try:
            path = client.download(ref, out_dir)
        except SkippedOutput as exc:
            skipped.append(f"node #{ref['node']}: {exc}")
            emit({"event": "skipped", "node": ref["node"], "reason": str(exc)})
            continue
        except DownloadError as exc:
            failures.append(str(exc))
            continue
        except (KeyboardInterrupt, RunTimeout) as exc:
            left = [client.view_url(r) for r in refs[index:]]
            action = "had finished; not downloaded: " + ", ".join(left)
            if isinstance(exc, RunTimeout):
                raise RunTimeout(f"{exc}; prompt {prompt_id} {action}") from None
            why = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
            emit({"event": "cancelled", "why": why, "prompt_id": prompt_id, "action": action})
            raise
        paths.append(path)
        emit({"event": "downloaded", "path": str(path), "bytes": path.stat().st_size,
              "filename": ref["filename"], "node": ref["node"]})
    if failures or skipped:
        saved = "".join(f"\n  saved: {p}" for p in paths)
        raise DownloadError("some outputs were not saved:\n  "
                            + "\n  ".join(failures + [f"skipped {s}" for s in skipped])
                            + saved)
    emit({"event": "done", "prompt_id": prompt_id, "paths": [str(p) for p in paths],
          "elapsed_s": round(time.monotonic() - t0, 1)})
    return paths


def output_files(entry: dict) -> list[dict]:
    """Every file a history entry lists: images (videos have `animated`), gifs, videos, audio.

    A ref's filename is as the server sent it (maybe not text); `download` decides whether it
    can be saved. An `outputs` that is not an object is the server's fault: ServerProtocolError.
    """
    outputs = entry.get("outputs") if isinstance(entry, dict) else None
    if outputs is None:
        return []
    if not isinstance(outputs, dict):
        raise ServerProtocolError(f"the history entry's 'outputs' is a "
                                  f"{type(outputs).__name__} ({outputs!r:.60}), not an object "
                                  f"of node ids; is --server a ComfyUI server?")
    refs, seen = [], set()
    for node_id, output in outputs.items():
        for kind, items in (output.items() if isinstance(output, dict) else ()):
            if not isinstance(items, list):
                continue
            for item in items:
                if not isinstance(item, dict) or "filename" not in item:
                    continue
                key = repr((item.get("type", "output"), item.get("subfolder", ""),
                            item["filename"]))
                if key not in seen:
                    seen.add(key)
                    refs.append({**item, "node": str(node_id), "kind": kind})
    return refs
