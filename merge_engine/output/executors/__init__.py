"""Where shard jobs run. Same plans, same bytes, different engines.

A job hands an executor its outputs: `PlannedOutput` (a safetensors folder: one shard job per output
shard, `merge_engine.output.shard_job`) or `PlannedFiles` (files a layout writes whole, one file job each:
``stepmerge split``'s Megatron rank files and DCP data files). Both are independent units of work.

- `local.LocalExecutor`: this process, ``workers`` shard jobs at once on threads (`merge_engine.output.writer`).
- `ray.RayExecutor`: a Ray cluster (the optional extra ``stepmerge[ray]``): each shard job is a Ray task
  that reads straight from the checkpoint's storage and writes straight to the target URL; only small
  `ShardRecord`s come back.

Contract of a `ShardExecutor`: ``write(job, outputs, url, chunk_bytes=, on_bytes=)`` writes every
output of ``job`` under the folder URL ``url`` (each output's shards and index, or its file jobs and
then their ``finish`` files; then its ``then`` files) and returns a `WrittenFiles`: (name relative to ``url``, size) per file and the sha256 of
every weight file and index it wrote. ``job`` is the `merge_engine.output.jobs.OutputJob` the outputs were
prepared from: an executor that runs shard jobs in other processes prepares it again there
(metadata only) and checks that it gets the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from merge_engine.layouts.contract import FileJob, FileRecord
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.formats.tensor_source import TensorSource

Files = list[tuple[str, int]]

__all__ = ["Files", "PlannedFiles", "PlannedOutput", "ShardExecutor", "WrittenFiles", "executor_for"]


@dataclass
class PlannedOutput:
    """One safetensors folder of a job: ``plan`` over ``source``, written into ``folder`` of the target
    ("" for the target itself); ``then(url)`` writes that folder's other files right after its shards."""

    plan: MergePlan
    source: TensorSource
    folder: str = ""
    then: Callable[[str], Files] | None = None


@dataclass
class PlannedFiles:
    """Files of one folder of a job (``folder`` of the target, "" for the target itself), each written
    whole by one independent file job: ``write_file(job, folder_url, cancel)`` writes one of ``jobs``
    (`merge_engine.layouts.contract.WritableLayout.write_file`: atomic, hashed while written, stops
    with `WriteCancelled` once the Event ``cancel`` is set) and returns its `FileRecord`;
    ``finish(records, folder_url)`` then writes what needs every job's record (their order: ``jobs``'),
    and ``then(url)`` the folder's other files."""

    jobs: list[FileJob]
    write_file: Callable[[FileJob, str, Any], FileRecord]
    finish: Callable[[list[FileRecord], str], list[FileRecord]] | None = None
    folder: str = ""
    then: Callable[[str], Files] | None = None


Output = PlannedOutput | PlannedFiles


@dataclass
class WrittenFiles:
    """What an executor wrote: (name, size) per file, and sha256 per weight file and index."""

    files: Files = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)


class ShardExecutor(Protocol):
    def write(self, job: Any, outputs: Sequence[Output], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles: ...


def executor_for(workers: int | None = None, ray_address: str | None = None) -> ShardExecutor:
    """The executor the options ask for: Ray when ``ray_address`` is given, else this machine's threads
    (``workers`` threads, shared out between shards and their byte ranges; None: one per core). A Ray address
    that names no live cluster is refused here, within seconds, before anything is read
    (`ray_address.check_ray_address`)."""
    if ray_address:
        from merge_engine.output.executors.ray import RayExecutor  # optional extra: imported only when asked for

        executor = RayExecutor(ray_address)
        executor.check_address()
        return executor
    from merge_engine.output.executors.local import LocalExecutor

    return LocalExecutor(workers)
