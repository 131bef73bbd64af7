"""A safetensors shard as a work unit (`merge_engine.output.work_unit.WorkUnit`), and a plan as a job's output.

`ShardUnit.run` writes one shard of a `MergePlan`: with one thread, read-ahead, writer and hasher threads
(`merge_engine.output.shard_job.write_shard`); with more, its byte ranges in parallel at their places
(`merge_engine.output.shard_ranges.write_shard_ranges`): the same file, bytes and record either way.
`shard_output` makes a plan's `PlannedOutput`: a unit per shard, then the index when there are several.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from merge_engine.formats.tensor_source import TensorSource
from merge_engine.storage.written import FileRecord
from merge_engine.output.shard_job import write_index, write_shard
from merge_engine.output.shard_ranges import write_shard_ranges
from merge_engine.output.work_unit import Files, PlannedOutput
from merge_engine.plan.merge_plan import MergePlan, ShardFile

__all__ = ["ShardUnit", "shard_output"]


@dataclass(frozen=True, eq=False)
class ShardUnit:
    """One shard of ``plan`` over ``source``: a `merge_engine.output.work_unit.WorkUnit`. With ``threads`` > 1
    its byte ranges are written in parallel (`merge_engine.output.shard_ranges`), else by `write_shard`."""

    plan: MergePlan
    shard: ShardFile
    source: TensorSource

    @property
    def planned(self) -> tuple[str, int, tuple[str, ...]]:
        return self.shard.filename, self.shard.size, tuple(self.shard.tensors)

    def run(self, folder_url: str, cancel: threading.Event | None = None, *, chunk_bytes: int, threads: int = 1,
            on_bytes: Callable[[int], None] | None = None) -> FileRecord:
        if threads > 1:
            return write_shard_ranges(self.plan, self.shard, self.source, folder_url, workers=threads,
                                      chunk_bytes=chunk_bytes, on_bytes=on_bytes, cancel=cancel)
        return write_shard(self.plan, self.shard, self.source, folder_url, chunk_bytes=chunk_bytes,
                           on_bytes=on_bytes, cancel=cancel)


def shard_output(plan: MergePlan, source: TensorSource, folder: str = "",
                 then: Callable[[str], Files] | None = None) -> PlannedOutput:
    """``plan`` over ``source`` as one output of a job: a `ShardUnit` per shard, then the index (several
    shards), then ``then(folder_url)``, into ``folder`` of the target ("" for the target itself)."""

    def index(records: list[FileRecord], folder_url: str) -> list[FileRecord]:
        written = write_index(plan, folder_url)
        return [written] if written is not None else []

    return PlannedOutput([ShardUnit(plan, shard, source) for shard in plan.shards], folder, index, then, plan)
