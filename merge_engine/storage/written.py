"""A written file's record and the stop of a write: what every writer hands back (a merge's shard, a layout's
rank or DCP file, an index) and what it raises when told to stop. Small, plain and picklable: a worker
process returns a `FileRecord`, and the coordinator writes indexes and manifests from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FileRecord", "WriteCancelled"]


@dataclass(frozen=True)
class FileRecord:
    """One written file, the record of every work unit (a merge's shard, a layout's file) and of the files
    written after them (an index, a DCP ``.metadata``): name relative to the output folder, size, sha256
    computed while writing, the tensors it holds (empty for an index) and ``items``: what the layout's
    writer's `finish` needs to know of it (a DCP data file's item locations); small and picklable,
    what a worker process hands back."""

    file: str
    size: int
    sha256: str
    tensors: tuple[str, ...] = ()
    items: tuple[Any, ...] = ()


class WriteCancelled(Exception):
    """A work unit stopped because another unit of the same job failed, or an interrupt (not a user-facing
    error: the other unit's error, or the interrupt, is the one reported)."""
