"""`write_plan`: a whole `MergePlan` written on this machine's threads, then its index, for tests (the
product writes through an executor: `merge_engine.output.jobs.run_job`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.storage.written import FileRecord
from merge_engine.output.shard_unit import shard_output
from merge_engine.output.writer import run_units
from merge_engine.plan.merge_plan import MergePlan


@dataclass(frozen=True)
class WrittenModel:
    """What `write_plan` produced: file names (relative to the target) with their sizes, and their records."""

    files: tuple[tuple[str, int], ...]
    tensor_bytes: int
    records: tuple[FileRecord, ...] = ()


def write_plan(plan: MergePlan, source: TensorSource, target_url: str, *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_bytes: Callable[[int], None] | None = None,
               workers: int | None = 1) -> WrittenModel:
    """Write every shard of ``plan`` under ``target_url`` (`run_units`), then the index when there are
    several shards. ``workers``: threads in all (None: one per core)."""
    output = shard_output(plan, source)
    records = run_units(output.units, target_url, workers=workers, chunk_bytes=chunk_bytes, on_bytes=on_bytes)
    records += output.finish(records, target_url)
    return WrittenModel(tuple((r.file, r.size) for r in records), plan.total_size, tuple(records))
