"""A dependency-free PNG bar chart for ``loopwarden capacity --plot`` (stdlib ``zlib`` only).

`bar_chart_png(values, path)` draws one bar per value (0..1 shares of requests, e.g. per
utilization bucket), left to right, on a white 640 x 320 canvas with a baseline and a 50 % /
100 % grid; bars over a ``warn_from`` index are drawn in red. There is no text: the capacity
report printed beside it names the buckets.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 640, 320, 20
WHITE, GREY, BLUE, RED, BLACK = (255, 255, 255), (220, 220, 220), (52, 101, 164), (204, 0, 0), (0, 0, 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def bar_chart_png(values: Sequence[float], path: str | Path, *, warn_from: int | None = None) -> None:
    """Write a PNG bar chart of `values` (each clamped to 0..1) to `path`. ValueError if empty."""
    if not values:
        raise ValueError("nothing to plot")
    pixels = [[WHITE] * WIDTH for _ in range(HEIGHT)]
    plot_h = HEIGHT - 2 * MARGIN
    for share in (0.5, 1.0):
        y = HEIGHT - MARGIN - round(share * plot_h)
        pixels[y] = [GREY] * WIDTH
    slot = (WIDTH - 2 * MARGIN) / len(values)
    for i, value in enumerate(values):
        height = round(max(0.0, min(1.0, value)) * plot_h)
        color = RED if warn_from is not None and i >= warn_from else BLUE
        x0, x1 = MARGIN + round(i * slot + slot * 0.1), MARGIN + round((i + 1) * slot - slot * 0.1)
        for y in range(HEIGHT - MARGIN - height, HEIGHT - MARGIN):
            row = pixels[y]
            for x in range(x0, max(x0 + 1, x1)):
                row[x] = color
    pixels[HEIGHT - MARGIN] = [BLACK] * WIDTH
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)
    png = b"\x89PNG\r\n\x1a\n"
    png += _chunk(b"IHDR", struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0))
    png += _chunk(b"IDAT", zlib.compress(raw, 9))
    png += _chunk(b"IEND", b"")
    Path(path).write_bytes(png)
