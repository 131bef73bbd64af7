"""Shard jobs on this machine: ``workers`` at once, on threads of this process (`merge_engine.writer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.executors import PlannedOutput, WrittenFiles
from merge_engine.writer import write_plan


def relative(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


class LocalExecutor:
    """Each output's shards ``workers`` at once (None: one per core, at most one per shard), then its files."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        written = WrittenFiles()
        for output in outputs:
            folder = storage.join(url, output.folder) if output.folder else url
            model = write_plan(output.plan, output.source, folder, chunk_bytes=chunk_bytes, on_bytes=on_bytes,
                               workers=self.workers)
            files = list(model.files) + (output.then(folder) if output.then is not None else [])
            written.files += [(relative(output.folder, name), size) for name, size in files]
            written.checksums.update({relative(output.folder, r.file): r.sha256 for r in model.records})
        return written


LOCAL = LocalExecutor(1)
