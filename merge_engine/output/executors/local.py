"""Work units on this machine: ``workers`` threads of this process, shared out between the units and their
byte ranges (`merge_engine.output.writer.run_units`, the one pool loop). Address: ``threads:N`` (``threads``:
one per core).

Threads, not processes: reads, casts, sha256 and writes release the GIL, and a thread shares the sources
already opened (measured by `benchmarks.shard_jobs`, see `merge_engine.output.writer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.errors import InvalidOption
from merge_engine.output.executors.contract import WrittenFiles, finish_output
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.output.writer import run_units

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Each output's units on ``workers`` threads (None: one per core), then its ``finish`` and ``then``."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    @classmethod
    def at(cls, rest: str) -> LocalExecutor:
        """``threads:N`` -> N threads; ``threads`` -> one per core."""
        if not rest:
            return cls(None)
        if not rest.isdigit() or int(rest) < 1:
            raise InvalidOption("the threads executor takes a number of threads, at least 1 (threads:N)",
                                f"threads:{rest}")
        return cls(int(rest))

    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        written = WrittenFiles()
        for output in outputs:
            folder = storage.join(url, output.folder) if output.folder else url
            records = run_units(output.units, folder, workers=self.workers, chunk_bytes=chunk_bytes,
                                on_bytes=on_bytes)
            finish_output(written, output, folder, records)
        return written


LOCAL = LocalExecutor(1)
