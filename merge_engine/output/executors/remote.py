"""What every executor that runs shard jobs in other processes shares: the task record, its body, the finish.

A `ShardTask` is everything a worker needs to write one shard (or one file job of a `PlannedFiles`:
split's rank files), and small: the `OutputJob` (URLs and
options), a key naming the job, the shard's place in the job's plans, the folder URL, and what the
coordinator planned for it (file, size, tensors). `run_shard_task` is the body a worker runs: it prepares
the job again there (metadata only: listing, headers, plan), once per worker process and job, checks
that its plan holds the same shard, and writes it with `write_shard` (a file job: with the layout's
``write_file``) straight from the checkpoint's storage to the target URL. `RemoteExecutor.write` plans
the tasks, hands them to `run_all` (Ray, or a Prefect task runner), then removes workers' debris and
writes each output's index (file jobs: their ``finish`` files) and its other files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.storage import tuning
from merge_engine.errors import CorruptShard
from merge_engine.output.executors import Output, PlannedFiles, WrittenFiles
from merge_engine.output.executors.local import relative
from merge_engine.output.shard_job import ShardRecord, write_index, write_shard
from merge_engine.storage.backend import TIMEOUT_ENV
from merge_engine.storage.schemes import registered_backends

__all__ = ["RemoteExecutor", "ShardTask", "apply_storage_env", "run_shard_task", "storage_env"]

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
    planned: tuple[str, int, tuple[str, ...]]  # file, tensor bytes (file jobs: -1), tensor names
    env: tuple[tuple[str, str], ...] = ()  # the coordinator's `storage_env`, applied by the worker

    @property
    def file(self) -> str:
        return self.planned[0]


def storage_env() -> dict[str, str]:
    """The environment variables every storage backend reads, as this process has them: what a worker
    needs to reach the same storage (endpoints, credentials, timeouts, requests in flight, read-ahead)."""
    keys = {key for backend in registered_backends() for key in getattr(backend, "env_keys", ())}
    keys.update((TIMEOUT_ENV, "STEPMERGE_REQUESTS_IN_FLIGHT", "STEPMERGE_READ_AHEAD_BYTES"))
    return {key: os.environ[key] for key in sorted(keys) if key in os.environ}


_WORKER_ENV: dict[str, str | None] = {}  # in a worker process: its own value of each key a task has set


def apply_storage_env(env: tuple[tuple[str, str], ...]) -> None:
    """Make this worker process see ``env`` (a coordinator's `storage_env`) as a Ray ``runtime_env`` would:
    those keys set, every key an earlier task set and this one does not back to the worker's own value.
    Storage clients are cached by these values (`storage.backend`), so a change reaches the next request."""
    wanted = dict(env)
    for key in set(_WORKER_ENV) | set(wanted):
        _WORKER_ENV.setdefault(key, os.environ.get(key))
        value = wanted.get(key, _WORKER_ENV[key])
        if os.environ.get(key) != value:
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    tuning.reload_from_env()


def _prepared(job: Any, key: str) -> Any:
    prepared = _PREPARED.get(key)
    if prepared is None:
        for old in _PREPARED.values():
            old.close()
        _PREPARED.clear()
        prepared = _PREPARED[key] = job.prepare()
    return prepared


def _planned(output: Output, index: int) -> tuple[str, int, tuple[str, ...]]:
    if isinstance(output, PlannedFiles):
        job = output.jobs[index]
        return job.file, -1, job.tensors
    shard = output.plan.shards[index]
    return shard.filename, shard.size, tuple(shard.tensors)


def _units(output: Output) -> int:
    return len(output.jobs) if isinstance(output, PlannedFiles) else len(output.plan.shards)


def run_shard_task(task: ShardTask) -> Any:
    """Write one shard (or file job) in this process (see the module docstring); its record."""
    apply_storage_env(task.env)
    output = _prepared(task.job, task.key).outputs[task.output_index]
    planned = _planned(output, task.shard_index)
    if planned != task.planned:
        raise CorruptShard(f"this worker planned {planned[0]} ({planned[1]} bytes) where the coordinator planned "
                           f"{task.planned[0]} ({task.planned[1]} bytes): the checkpoint changed during the merge",
                           task.job.source_url)
    if isinstance(output, PlannedFiles):
        return output.write_file(output.jobs[task.shard_index], task.folder_url, None)
    shard = output.plan.shards[task.shard_index]
    return write_shard(output.plan, shard, output.source, task.folder_url, chunk_bytes=task.chunk_bytes)


class RemoteExecutor:
    """Shard jobs in other processes; a subclass says how in `run_all`."""

    def run_all(self, tasks: list[ShardTask], on_record: Callable[[ShardRecord], None]) -> list[ShardRecord]:
        """Run every task; their records in the order of ``tasks``. The first named error is raised once
        the other tasks have stopped; a task whose worker died is run again."""
        raise NotImplementedError

    def write(self, job: Any, outputs: Sequence[Output], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        key = f"{job.command}:{job.target_url}:{job.fingerprint()}"
        folders = [storage.join(url, o.folder) if o.folder else url for o in outputs]
        tasks = [ShardTask(job, key, output_index, unit, folder, chunk_bytes, _planned(output, unit))
                 for output_index, (output, folder) in enumerate(zip(outputs, folders))
                 for unit in range(_units(output))]
        records = self.run_all(tasks, (lambda r: on_bytes(r.size)) if on_bytes is not None else (lambda r: None))
        written = WrittenFiles()
        for output_index, (output, folder) in enumerate(zip(outputs, folders)):
            mine = [r for t, r in zip(tasks, records) if t.output_index == output_index]
            remove_debris(folder, [r.file for r in mine])
            if isinstance(output, PlannedFiles):
                mine += output.finish(mine, folder) if output.finish is not None else []
            else:
                index = write_index(output.plan, folder)
                if index is not None:
                    mine.append(index)
            files = [(r.file, r.size) for r in mine] + (output.then(folder) if output.then is not None else [])
            written.files += [(relative(output.folder, name), size) for name, size in files]
            written.checksums.update({relative(output.folder, r.file): r.sha256 for r in mine})
        return written


def remove_debris(folder: str, files: list[str]) -> None:
    """Remove the temp files (``.<name>.tmp-*`` beside each of ``files``, which may lie in subfolders) that
    workers killed while writing left in a local ``folder`` (an object store never shows an unfinished
    upload)."""
    if not storage.is_local(folder):
        return
    by_parent: dict[str, set[str]] = {}
    for file in files:
        parent, _, name = file.rpartition("/")
        by_parent.setdefault(parent, set()).add(name)
    for parent, names in by_parent.items():
        where = storage.join(folder, parent) if parent else folder
        if not storage.exists(where):
            continue
        for entry in storage.list_files(where, recursive=False):
            if any(entry.path.startswith(f".{name}.tmp-") for name in names):
                storage.remove(storage.join(where, entry.path))
