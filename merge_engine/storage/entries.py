"""What a listing holds (`FileEntry`) and the fingerprint made of it: the core of every cache key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FileEntry:
    """One file under a listed root: path relative to the root (``/``-separated), size, version."""

    path: str
    size: int
    version: str


def fingerprint(entries: Iterable[FileEntry], **options: Any) -> str:
    """A stable sha256 of a listing (names, sizes, versions) plus options: the cache key's core.

    Independent of the order of ``entries`` and of ``options``; any change of a name, size,
    version or option value changes it.
    """
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.size}\0{entry.version}\n".encode())
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    return digest.hexdigest()
