"""Shard jobs on this machine: ``workers`` threads of this process, shared out between the shards and
their byte ranges (`merge_engine.output.writer`, `merge_engine.output.shard_ranges`).

Threads, not processes: reads, casts, sha256 and writes release the GIL, and a thread shares the
sources already opened (measured by `benchmarks.shard_jobs`, see `merge_engine.output.writer`). The file jobs
of a `PlannedFiles` (split's rank files) run the same way, ``workers`` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from merge_engine import storage

from merge_engine.output import interrupts
from merge_engine.output.executors import Output, PlannedFiles, WrittenFiles
from merge_engine.layouts.contract import FileRecord, WriteCancelled
from merge_engine.output.writer import default_workers, run_jobs, serialised, write_plan


def relative(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def write_files(output: PlannedFiles, folder_url: str, workers: int | None,
                on_bytes: Callable[[int], None] | None = None) -> list[FileRecord]:
    """Every file job of ``output`` under ``folder_url``, ``workers`` at once (None: one per core, at most
    one per job), then its ``finish`` files; the records in job order, then finish's.

    The first failure, or an interrupt (`merge_engine.output.interrupts`), stops the rest (jobs not started
    are dropped, running ones stop at their next tensor) and is raised once they have stopped."""
    count = default_workers(len(output.jobs)) if workers is None else max(1, workers)
    progress = serialised(on_bytes)
    cancel = interrupts.cancel_event()

    def run(position: int) -> FileRecord:
        record = output.write_file(output.jobs[position], folder_url, cancel)
        if progress is not None:
            progress(record.size)
        return record

    if count == 1 or len(output.jobs) <= 1:
        records = [run(position) for position in range(len(output.jobs))]
    else:
        records = run_jobs(run, len(output.jobs), count, cancel, stopped=WriteCancelled, name="stepmerge-file")
    if output.finish is not None:
        records += output.finish(records, folder_url)
    return records


class LocalExecutor:
    """Each output's shards on ``workers`` threads, shared out between shards and their byte ranges
    (`merge_engine.output.writer`; None: one per core), or its file jobs ``workers`` at once (None: one per core,
    at most one per job), then its files."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def write(self, job: Any, outputs: Sequence[Output], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        written = WrittenFiles()
        for output in outputs:
            folder = storage.join(url, output.folder) if output.folder else url
            if isinstance(output, PlannedFiles):
                records: Sequence[Any] = write_files(output, folder, self.workers, on_bytes)
                files = [(r.file, r.size) for r in records]
            else:
                model = write_plan(output.plan, output.source, folder, chunk_bytes=chunk_bytes, on_bytes=on_bytes,
                                   workers=self.workers)
                records, files = model.records, list(model.files)
            files += output.then(folder) if output.then is not None else []
            written.files += [(relative(output.folder, name), size) for name, size in files]
            written.checksums.update({relative(output.folder, r.file): r.sha256 for r in records})
        return written


LOCAL = LocalExecutor(1)
