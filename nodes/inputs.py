"""Node input parsing and validation, as plain functions (tested on CPU).

Each `check_*` returns None when the inputs are good, else one message that names the bad
value and the fix; the V3 nodes return it from `validate_inputs`, so ComfyUI shows it on the
node before anything loads. Each `parse_*` turns a widget string into the value the library
wants, raising ValueError with the same kind of message.
"""

from __future__ import annotations

from ..common import geometry
from ..common.checks import check_canvas, check_seconds, check_two_pass  # noqa: F401

# check_canvas, check_two_pass and check_seconds are shared with the API client, so they live
# in common/checks.py; the nodes reach them here, with the rest of their input rules.

AUTO = "auto"
DURATION_CHOICES = (5, 10, 12, 15)  # seconds the model was trained around (124..362 frames)
MAX_DIGITS = 15  # longer "numbers" are typos (and int() refuses 4300 digits)
SHOWN_CHARS = 60


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for a message, cut to `limit` characters: a pasted novel stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def whole_number(text: str) -> int | None:
    """An optionally signed run of ASCII digits as an int, else None.

    Not `str.isdigit()` + `int()`: isdigit accepts '²' (which int() refuses with a raw message)
    and int() reads '١٢' and '1_0' as numbers nobody typed on purpose.
    """
    body = text.strip()
    digits = body[1:] if body[:1] in "+-" else body
    if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_DIGITS):
        return None
    return int(body)


def seconds_to_frames(seconds: float) -> tuple[int, float]:
    """Seconds -> (frames on the 17k+5 grid, the clip's real length in seconds)."""
    frames = geometry.snap_frames(seconds)
    return frames, frames / geometry.FPS


def frames_for_latent(latent_t: int) -> int:
    """Latent frames T -> pixel frames F (the inverse of geometry.latent_frames)."""
    if latent_t < 2 or (latent_t - 2) % 5:
        raise ValueError(f"{latent_t} latent frames is not an H3 video latent (T = 2 + 5k)")
    frames = geometry.MIN_FRAMES + (latent_t - 2) // 5 * geometry.FRAME_STEP
    assert geometry.latent_frames(frames) == latent_t
    return frames


def check_profile(devices: str, profiles: list[str]) -> str | None:
    if devices == AUTO or devices in profiles:
        return None
    return (f"devices {shown(devices)} is not a known hardware profile; use 'auto' (this machine's "
            f"GPUs) or one of {', '.join(profiles)}")


def parse_auto_int(text: str | int, name: str, minimum: int = 0) -> int | str:
    """'auto' -> 'auto'; '12' or 12 -> 12 (>= minimum); anything else raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        stripped = str(text).strip().lower()
        if stripped in (AUTO, ""):
            return AUTO
        value = whole_number(stripped)
        if value is None:
            raise ValueError(f"{name}={shown(text)} is not 'auto' or a whole number")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum} (or 'auto')")
    return value


def parse_int(text: str | int, name: str, minimum: int = 0, example: int = 2) -> int:
    """'3' or 3 -> 3 (>= minimum); anything else (a float, 'abc', '²') raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        value = whole_number(text) if isinstance(text, str) else None
        if value is None:
            raise ValueError(f"{name}={shown(text)} is not a whole number; give e.g. {example}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum} (e.g. {example})")
    return value


def check_auto_int(text: str, name: str, minimum: int = 0) -> str | None:
    try:
        parse_auto_int(text, name, minimum)
    except ValueError as exc:
        return str(exc)
    return None


MAX_BYTES = 2**50  # 1 PiB: a bound that keeps byte counts finite integers
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, name: str) -> int | None:
    """'auto' -> None; '24GiB', '24 GB', '1.5gib' or a byte count -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        stripped = str(text).strip().lower().replace(" ", "")
        if stripped in (AUTO, ""):
            return None
        digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = stripped[len(digits):]
        try:
            value = float(digits)
        except ValueError:
            value = -1.0
        if unit not in _UNITS:
            value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{name}={shown(text)} is not 'auto' or a size such as '24GiB'")
    if value * _UNITS[unit] > MAX_BYTES:  # also inf ('1e400')
        raise ValueError(f"{name}={shown(text)} is more than any machine's memory (over 1 PiB); "
                         f"give a size such as '24GiB' or 'auto'")
    return int(value * _UNITS[unit])


def parse_split(text: str) -> tuple[int, ...] | str:
    """'auto' or '28:28' (heads per GPU, root first) -> tuple; must sum to H3's 56 heads."""
    stripped = str(text).strip().lower()
    if stripped in (AUTO, ""):
        return AUTO
    parts = tuple(whole_number(p) for p in stripped.replace(",", ":").split(":"))
    if None in parts:
        raise ValueError(f"split {shown(text)} is not 'auto' or heads per GPU like '28:28'")
    if len(parts) < 2 or any(p <= 0 for p in parts):
        raise ValueError(f"split {shown(text)} needs two or more positive head counts, root first "
                         f"(e.g. '28:28')")
    if sum(parts) != geometry.HEADS:
        raise ValueError(f"split {shown(text)} gives {sum(parts)} heads; H3 has {geometry.HEADS} "
                         f"(e.g. '28:28' or '32:24')")
    return parts


def first_message(*messages: str | None) -> str | bool:
    """validate_inputs' answer: the first message, or True when all passed."""
    for message in messages:
        if message:
            return message
    return True
