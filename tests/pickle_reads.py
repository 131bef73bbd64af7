"""Where a ``torch.save`` file keeps its pickle, and how many times reads fetched it (tests of issue 18 point 5)."""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path


def pickle_range(path: str | Path) -> tuple[int, int]:
    """Byte range of a local ``torch.save`` file's ``data.pkl`` record data (its local header skipped)."""
    with zipfile.ZipFile(path) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.compress_size


def pickle_fetches(reads: Iterable[tuple[str, int, int]], url: str, pickle: tuple[int, int]) -> float:
    """How many times the reads ``(url, start, end)`` fetched the bytes ``pickle`` of the file at ``url``."""
    lo, hi = pickle
    return sum(max(0, min(end, hi) - max(start, lo)) for u, start, end in reads if u == url) / (hi - lo)
