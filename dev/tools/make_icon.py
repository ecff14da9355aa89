"""Draw the pack's icon for the ComfyUI Registry: docs/images/icon.png, 400x400.

Two GPU cards joined by a link under "H3". Pure Python (zlib + struct), so it runs where no
imaging library is installed:

    python dev/tools/make_icon.py
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

SIZE = 400
OUT = Path(__file__).resolve().parents[2] / "docs" / "images" / "icon.png"
BACKGROUND = (22, 27, 34)
CARD = ((46, 160, 67), (218, 54, 51))  # the two GPUs (green and red: CUDA and ROCm)
CHIP = (230, 237, 243)
LINK = (88, 166, 255)
# 5x7 letters of "H3", one string per row
GLYPHS = {
    "H": ["X...X", "X...X", "X...X", "XXXXX", "X...X", "X...X", "X...X"],
    "3": ["XXXX.", "....X", "....X", ".XXX.", "....X", "....X", "XXXX."],
}

Pixel = tuple[int, int, int]


def _rounded(img: list[list[Pixel]], x0: int, y0: int, x1: int, y1: int, r: int,
             color: Pixel) -> None:
    """Fill the rectangle [x0, x1) x [y0, y1) with corners of radius r."""
    for y in range(y0, y1):
        for x in range(x0, x1):
            cx = min(max(x, x0 + r), x1 - 1 - r)
            cy = min(max(y, y0 + r), y1 - 1 - r)
            if (x - cx) ** 2 + (y - cy) ** 2 <= r * r:
                img[y][x] = color


def draw() -> list[list[Pixel]]:
    img = [[BACKGROUND] * SIZE for _ in range(SIZE)]
    cell, gap = 14, 20  # "H3" in 14-pixel cells, centred at the top
    width = 2 * 5 * cell + gap
    for i, letter in enumerate("H3"):
        left = (SIZE - width) // 2 + i * (5 * cell + gap)
        for row, line in enumerate(GLYPHS[letter]):
            for col, mark in enumerate(line):
                if mark == "X":
                    x, y = left + col * cell, 30 + row * cell
                    _rounded(img, x, y, x + cell, y + cell, 0, CHIP)
    for i, color in enumerate(CARD):
        x0 = 36 + i * 180
        _rounded(img, x0, 170, x0 + 148, 340, 18, color)  # the card
        _rounded(img, x0 + 34, 215, x0 + 114, 295, 10, CHIP)  # its chip
        for k in range(5):  # the fan's slots below the chip
            _rounded(img, x0 + 24 + k * 22, 312, x0 + 36 + k * 22, 326, 3, CHIP)
    _rounded(img, 176, 240, 224, 270, 6, LINK)  # the link between the GPUs
    return img


def png_bytes(img: list[list[Pixel]]) -> bytes:
    """An 8-bit RGB PNG: signature, IHDR, one IDAT (filter 0 on every row), IEND."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    height, width = len(img), len(img[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


if __name__ == "__main__":
    OUT.write_bytes(png_bytes(draw()))
    print(OUT)
