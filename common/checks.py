"""H3's canvas, two-pass and clip-length rules as messages: None when good, else one line that
names the bad value and the fix.

Both the V3 nodes (their `validate_inputs`) and the API client (`submit --check`) run these,
so a graph the client accepts is one the nodes accept; they sit here, below both, because the
client and the nodes are sibling layers that must not import each other.
"""

from __future__ import annotations

from . import geometry


def check_canvas(width: int, height: int, label: str) -> str | None:
    try:
        geometry.validate_canvas(width, height)
    except ValueError as exc:
        return f"{label}: {exc}"
    return None


def check_two_pass(pass1_width: int, pass1_height: int, pass2_width: int, pass2_height: int
                   ) -> str | None:
    """Both canvases valid for H3 and PASS2 no smaller than PASS1 in either side."""
    for message in (check_canvas(pass1_width, pass1_height, "PASS1"),
                    check_canvas(pass2_width, pass2_height, "PASS2")):
        if message:
            return message
    try:
        geometry.validate_two_pass(pass1_width, pass1_height, pass2_width, pass2_height)
    except ValueError as exc:
        return str(exc)
    return None


def check_seconds(seconds: float) -> str | None:
    try:
        geometry.snap_frames(seconds)
    except ValueError as exc:
        return str(exc)
    return None
