"""Output files: names from the server made safe, new files only, a size limit.

A name comes from the server, so it is data, not a path: only its last component is kept,
control characters (a newline would inject lines into the printed path list, a NUL aborts
`open`) and characters Windows refuses become `_`, and it is cut to 200 bytes. A name that is
not text, or nothing but dots, cannot be saved: the caller lists it as skipped and goes on.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import DownloadError

MAX_NAME_BYTES = 200  # leaves room under the usual 255-byte limit for "_123" and a suffix
DEFAULT_MAX_DOWNLOAD_BYTES = 16 << 30  # per file; an H3 clip is tens of MB
_WINDOWS_FORBIDDEN = set('<>:"|?*')
_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)),
                     *(f"LPT{i}" for i in range(1, 10))}


def safe_file_name(name: object) -> tuple[str | None, str]:
    """(a local file name, "") or (None, why the output cannot be saved)."""
    if not isinstance(name, str):
        return None, f"its file name is {name!r}, not text"
    last = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = "".join("_" if ord(c) < 32 or ord(c) == 127 or c in _WINDOWS_FORBIDDEN else c
                      for c in last).strip(" ")
    if not cleaned.strip("."):
        return None, f"its file name {name!r} is not a file name"
    stem, suffix = os.path.splitext(cleaned)
    if len(suffix.encode()) > 16:  # not a real extension: keep it in the stem, cut with it
        stem, suffix = cleaned, ""
    if stem.split(".")[0].upper() in _WINDOWS_RESERVED:
        stem = "_" + stem
    budget = MAX_NAME_BYTES - len(suffix.encode())
    stem = stem.encode()[:budget].decode("utf-8", "ignore")
    return stem + suffix, ""


def exclusive_file(out_dir: Path, name: str, limit: int = 10_000):
    """Open a new file `name`, or `stem_1.ext`, `stem_2.ext`...; never an existing one.

    Opening with O_EXCL makes the check and the creation one step, so two runs writing to the
    same folder cannot pick the same name.
    """
    stem, suffix = os.path.splitext(name)
    for index in range(limit):
        candidate = out_dir / (name if index == 0 else f"{stem}_{index}{suffix}")
        try:
            return candidate, open(candidate, "xb")
        except FileExistsError:
            continue
    raise DownloadError(f"{out_dir} already holds {limit} files named like {name}; pick another "
                        f"--out folder")


def parse_size(text: str) -> int:
    """'16GiB', '500MB', '2e9' or a byte count -> bytes (for --max-download)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    stripped = str(text).strip().lower().replace(" ", "")
    digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(digits):]
    try:
        value = float(digits) * units[unit]
    except (ValueError, KeyError):
        value = -1.0
    if not 0 < value <= 2**50:  # also NaN and inf
        raise ValueError(f"size {text!r} is not a size such as '16GiB' or '500MB' "
                         f"(more than 0, at most 1 PiB)")
    return int(value)
