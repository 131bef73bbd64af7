"""What every executor that runs work units in other processes shares: the task record, its body, the finish.

A `UnitTask` is everything a worker needs to write one unit (a safetensors shard, a rank file of
``split``...), and small: the `OutputJob` (URLs and options), a key naming the job, the unit's place in the
job's outputs, the folder URL, and what the coordinator planned for it (file, size, tensors). `run_unit_task`
is the body a worker runs: it gets the job's prepared outputs there (`prepared_outputs`: the job prepared
again, once per worker process and job, from the checked checkpoint the job carries: its listing, config and
parsed tensor index, so no header is read again, only the plan is made), checks that its unit there
is the one the coordinator planned, and runs it (`WorkUnit.run`) straight from the checkpoint's storage to
the target URL. `RemoteExecutor.write` makes the tasks, hands them to `run_all` (Ray, or a Prefect task
runner), then removes workers' debris and finishes each output (its ``finish`` and ``then`` files).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.storage import tuning
from merge_engine.errors import CorruptShard, UnsafeRecord
from merge_engine.storage.written import FileRecord
from merge_engine.output.executors.contract import WrittenFiles, finish_output
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.storage.backend import TIMEOUT_ENV
from merge_engine.storage.schemes import registered_backends

__all__ = ["RemoteExecutor", "UnitTask", "apply_storage_env", "prepared_outputs", "run_unit_task", "storage_env",
           "storage_env_keys"]

_PREPARED: dict[str, Any] = {}  # in a worker process: job key -> its PreparedJob (sources open)


@dataclass(frozen=True)
class UnitTask:
    """One work unit for another process: ``job`` (an `OutputJob`), ``key`` (names the job's output),
    the unit's place (``output_index``, ``unit_index``), where it goes, and what was planned for it."""

    job: Any
    key: str
    output_index: int
    unit_index: int
    folder_url: str
    chunk_bytes: int
    planned: tuple[str, int, tuple[str, ...]]  # `WorkUnit.planned`: file, bytes (-1: not known), tensor names
    env: tuple[tuple[str, str], ...] = ()  # the coordinator's `storage_env`, applied by the worker
    threads: int = 1  # threads the unit may use on its byte ranges (`WorkUnit.run`): the CPUs its task holds

    @property
    def file(self) -> str:
        return self.planned[0]


def storage_env_keys() -> frozenset[str]:
    """The environment variables every storage backend reads (endpoints, credentials, timeouts, requests in
    flight, read-ahead): the only ones a task may set in a worker."""
    keys = {key for backend in registered_backends() for key in getattr(backend, "env_keys", ())}
    keys.update((TIMEOUT_ENV, "STEPMERGE_REQUESTS_IN_FLIGHT", "STEPMERGE_READ_AHEAD_BYTES"))
    return frozenset(keys)


def storage_env() -> dict[str, str]:
    """`storage_env_keys` as this process has them: what a worker needs to reach the same storage."""
    return {key: os.environ[key] for key in sorted(storage_env_keys()) if key in os.environ}


_WORKER_ENV: dict[str, str | None] = {}  # in a worker process: its own value of each key a task has set


def apply_storage_env(env: tuple[tuple[str, str], ...], where: str | None = None) -> None:
    """Make this worker process see ``env`` (a coordinator's `storage_env`) as a Ray ``runtime_env`` would:
    those keys set, every key an earlier task set and this one does not back to the worker's own value.
    Storage clients are cached by these values (`storage.backend`), so a change reaches the next request.
    A key that is not a storage setting (`storage_env_keys`: never ``PATH``, ``LD_PRELOAD``, ``PYTHONPATH``...)
    is `UnsafeRecord` naming ``where`` (the job's source), nothing set: a task decides where the worker's storage is, never what code it loads."""
    wanted = dict(env)
    allowed = storage_env_keys()
    foreign = sorted(key for key in wanted if key not in allowed)
    if foreign:
        raise UnsafeRecord(f"a work unit sets the environment variable {foreign[0][:100]!r}, which is not a "
                           "storage setting; nothing was set", where)
    for key in set(_WORKER_ENV) | set(wanted):
        _WORKER_ENV.setdefault(key, os.environ.get(key))
        value = wanted.get(key, _WORKER_ENV[key])
        if os.environ.get(key) != value:
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    tuning.reload_from_env()


def prepared_outputs(job: Any, key: str) -> list[PlannedOutput]:
    """The outputs of ``job`` (named ``key``) in this worker process: prepared once per process and job (the
    last job's sources are closed when another job comes)."""
    prepared = _PREPARED.get(key)
    if prepared is None:
        for old in _PREPARED.values():
            old.close()
        _PREPARED.clear()
        prepared = _PREPARED[key] = job.prepare()
    return prepared.outputs


def run_unit_task(task: UnitTask) -> FileRecord:
    """Write one work unit in this process (see the module docstring); its record."""
    apply_storage_env(task.env, getattr(task.job, "source_url", None))
    unit = prepared_outputs(task.job, task.key)[task.output_index].units[task.unit_index]
    planned = unit.planned
    if planned != task.planned:
        raise CorruptShard(f"this worker planned {planned[0]} ({planned[1]} bytes) where the coordinator planned "
                           f"{task.planned[0]} ({task.planned[1]} bytes): the checkpoint changed during the merge",
                           task.job.source_url)
    return unit.run(task.folder_url, None, chunk_bytes=task.chunk_bytes, threads=task.threads)


class RemoteExecutor:
    """Work units in other processes; a subclass says how in `run_all`."""

    def run_all(self, tasks: list[UnitTask], on_record: Callable[[FileRecord], None]) -> list[FileRecord]:
        """Run every task; their records in the order of ``tasks``. The first named error is raised once
        the other tasks have stopped; a task whose worker died is run again."""
        raise NotImplementedError

    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        key = f"{job.command}:{job.target_url}:{job.fingerprint()}"
        folders = [storage.join(url, o.folder) if o.folder else url for o in outputs]
        tasks = [UnitTask(job, key, output_index, unit_index, folder, chunk_bytes, unit.planned)
                 for output_index, (output, folder) in enumerate(zip(outputs, folders))
                 for unit_index, unit in enumerate(output.units)]
        records = self.run_all(tasks, (lambda r: on_bytes(r.size)) if on_bytes is not None else (lambda r: None))
        written = WrittenFiles()
        for output_index, (output, folder) in enumerate(zip(outputs, folders)):
            mine = [r for t, r in zip(tasks, records) if t.output_index == output_index]
            remove_debris(folder, [r.file for r in mine])
            finish_output(written, output, folder, mine)
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
