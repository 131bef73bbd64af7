"""What every executor that runs shard jobs in other processes shares: the task record, its body, the finish.

A `ShardTask` is everything a worker needs to write one shard, and small: the `OutputJob` (URLs and
options), a key naming the job, the shard's place in the job's plans, the folder URL, and what the
coordinator planned for it (file, size, tensors). `run_shard_task` is the body a worker runs: it prepares
the job again there (metadata only: listing, headers, plan), once per worker process and job, checks
that its plan holds the same shard, and writes it with `write_shard` straight from the checkpoint's
storage to the target URL. `RemoteExecutor.write` plans the tasks, hands them to `run_all` (Ray, or a
Prefect task runner), then removes workers' debris and writes each output's index and files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.executors import PlannedOutput, WrittenFiles
from merge_engine.executors.local import relative
from merge_engine.shard_job import ShardRecord, write_index, write_shard
from merge_engine.storage.backend import TIMEOUT_ENV
from merge_engine.storage.schemes import registered_backends

__all__ = ["RemoteExecutor", "ShardTask", "run_shard_task", "storage_env"]

_PREPARED: dict[str, Any] = {}  # in a worker process: job key -> its PreparedJob (sources open)


@dataclass(frozen=True)
class ShardTask:
    """One shard job for another process: ``job`` (an `OutputJob`), ``key`` (names the job's output),
    the shard's place (``output_index``, ``shard_index``), where it goes, and what was planned for it."""

    job: Any
    key: str
    output_index: int
    shard_index: int
    folder_url: str
    chunk_bytes: int
    planned: tuple[str, int, tuple[str, ...]]  # file, tensor bytes, tensor names

    @property
    def file(self) -> str:
        return self.planned[0]


def storage_env() -> dict[str, str]:
    """The environment variables every storage backend reads, as this process has them: what a worker
    needs to reach the same storage (endpoints, credentials, timeouts, requests in flight)."""
    keys = {key for backend in registered_backends() for key in getattr(backend, "env_keys", ())}
    keys.update((TIMEOUT_ENV, "STEPMERGE_REQUESTS_IN_FLIGHT"))
    return {key: os.environ[key] for key in sorted(keys) if key in os.environ}


def _prepared(job: Any, key: str) -> Any:
    prepared = _PREPARED.get(key)
    if prepared is None:
        for old in _PREPARED.values():
            old.close()
        _PREPARED.clear()
        prepared = _PREPARED[key] = job.prepare()
    return prepared


def run_shard_task(task: ShardTask) -> ShardRecord:
    """Write one shard in this process (see the module docstring)."""
    output = _prepared(task.job, task.key).outputs[task.output_index]
    shard = output.plan.shards[task.shard_index]
    if (shard.filename, shard.size, tuple(shard.tensors)) != task.planned:
        raise CorruptShard(f"this worker planned {shard.filename} ({shard.size} bytes) where the coordinator planned "
                           f"{task.planned[0]} ({task.planned[1]} bytes): the checkpoint changed during the merge",
                           task.job.source_url)
    return write_shard(output.plan, shard, output.source, task.folder_url, chunk_bytes=task.chunk_bytes)


class RemoteExecutor:
    """Shard jobs in other processes; a subclass says how in `run_all`."""

    def run_all(self, tasks: list[ShardTask], on_record: Callable[[ShardRecord], None]) -> list[ShardRecord]:
        """Run every task; their records in the order of ``tasks``. The first named error is raised once
        the other tasks have stopped; a task whose worker died is run again."""
        raise NotImplementedError

    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        key = f"{job.command}:{job.target_url}:{job.fingerprint()}"
        folders = [storage.join(url, o.folder) if o.folder else url for o in outputs]
        tasks = [ShardTask(job, key, output_index, shard_index, folder, chunk_bytes,
                           (shard.filename, shard.size, tuple(shard.tensors)))
                 for output_index, (output, folder) in enumerate(zip(outputs, folders))
                 for shard_index, shard in enumerate(output.plan.shards)]
        records = self.run_all(tasks, (lambda r: on_bytes(r.size)) if on_bytes is not None else (lambda r: None))
        written = WrittenFiles()
        for output_index, (output, folder) in enumerate(zip(outputs, folders)):
            mine = [r for t, r in zip(tasks, records) if t.output_index == output_index]
            remove_debris(folder, [r.file for r in mine])
            index = write_index(output.plan, folder)
            if index is not None:
                mine.append(index)
            files = [(r.file, r.size) for r in mine] + (output.then(folder) if output.then is not None else [])
            written.files += [(relative(output.folder, name), size) for name, size in files]
            written.checksums.update({relative(output.folder, r.file): r.sha256 for r in mine})
        return written


def remove_debris(folder: str, shards: list[str]) -> None:
    """Remove the temp files (``.<shard>.tmp-*``) that workers killed while writing a shard left in a local
    ``folder`` (an object store never shows an unfinished upload)."""
    if not storage.is_local(folder):
        return
    for entry in storage.list_files(folder, recursive=False):
        if any(entry.path.startswith(f".{shard}.tmp-") for shard in shards):
            storage.remove(storage.join(folder, entry.path))
