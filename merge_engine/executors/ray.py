"""Shard jobs as tasks of a Ray cluster (the optional extra: ``pip install 'stepmerge[ray]'``).

Each shard job is one Ray task. The task receives the `OutputJob` (a small record: URLs and options),
prepares it again on its worker (metadata only: listing, headers, plan; once per worker process and
job, kept for the worker's next shard of the same job), checks that its plan holds the same shard the
coordinator planned, and writes that shard straight from the checkpoint's storage to the target URL.
No weight byte passes through the coordinator or Ray's object store: only `ShardRecord`s come back.

- Retries: a task whose worker dies (node lost, OOM-killed, SIGKILL) is run again by Ray
  (``max_retries``); the shard is written whole again (`write_shard` is atomic per file). A named
  error (a truncated rank file, ...) is not retried: the first one cancels the other tasks and is
  raised once they have stopped.
- Debris: a worker killed mid-shard can leave its temp file (``.<shard>.tmp-*``) in a local target
  folder; after the shard tasks such files are removed, so the target gets exactly the planned files.
- The storage settings of the coordinator (the environment variables each storage backend reads:
  endpoints, credentials, timeouts) travel with every task (``runtime_env``), so the workers reach the
  same storage as the coordinator.
- ``address``: "auto" (a cluster started with ``ray start``), ``ray://host:port`` (Ray Client), or
  ``local`` (a private cluster of this machine); when this process is already connected to Ray
  (``ray.init`` was called), that connection is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, InvalidOption, StepmergeError
from merge_engine.executors import PlannedOutput, WrittenFiles
from merge_engine.executors.local import relative
from merge_engine.shard_job import ShardRecord, write_index, write_shard
from merge_engine.storage.schemes import registered_backends
from merge_engine.storage.backend import TIMEOUT_ENV

__all__ = ["RayExecutor", "run_shard_task"]

DEFAULT_MAX_RETRIES = 3

_PREPARED: dict[str, Any] = {}  # in a worker process: job key -> its PreparedJob (sources open)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidOption("--ray-address needs Ray: pip install 'stepmerge[ray]'") from None
    return ray


def storage_env() -> dict[str, str]:
    """The environment variables every storage backend reads, as this process has them."""
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


def run_shard_task(job: Any, key: str, output_index: int, shard_index: int, folder_url: str, chunk_bytes: int,
                   planned: tuple[str, int, tuple[str, ...]]) -> ShardRecord:
    """The body of one Ray task: prepare ``job`` here (cached per ``key``), check the shard is the one the
    coordinator ``planned`` (file, size, tensors), write it."""
    output = _prepared(job, key).outputs[output_index]
    shard = output.plan.shards[shard_index]
    if (shard.filename, shard.size, tuple(shard.tensors)) != planned:
        raise CorruptShard(f"the worker planned {shard.filename} ({shard.size} bytes) where the coordinator planned "
                           f"{planned[0]} ({planned[1]} bytes): the checkpoint changed during the merge",
                           job.source_url)
    return write_shard(output.plan, shard, output.source, folder_url, chunk_bytes=chunk_bytes)


class RayExecutor:
    """Shard jobs as Ray tasks (see the module docstring)."""

    def __init__(self, address: str | None = "auto", *, max_retries: int = DEFAULT_MAX_RETRIES,
                 num_cpus: float = 1) -> None:
        self.address = address
        self.max_retries = max_retries
        self.num_cpus = num_cpus

    def _connect(self) -> Any:
        ray = _import_ray()
        if not ray.is_initialized():
            address = None if self.address in (None, "", "local") else self.address
            ray.init(address=address, log_to_driver=False, include_dashboard=False,
                     configure_logging=False) if address is None else \
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        return ray

    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles:
        ray = self._connect()
        task = ray.remote(run_shard_task).options(
            max_retries=self.max_retries, retry_exceptions=False, num_cpus=self.num_cpus,
            runtime_env={"env_vars": storage_env()}, name="stepmerge-shard")
        key = f"{job.command}:{job.target_url}:{job.fingerprint()}"
        refs: list[tuple[int, Any]] = []
        folders = [storage.join(url, o.folder) if o.folder else url for o in outputs]
        for output_index, (output, folder) in enumerate(zip(outputs, folders)):
            for shard_index, shard in enumerate(output.plan.shards):
                planned = (shard.filename, shard.size, tuple(shard.tensors))
                refs.append((output_index, task.remote(job, key, output_index, shard_index, folder, chunk_bytes,
                                                       planned)))
        records = self._gather(ray, refs, on_bytes)
        written = WrittenFiles()
        for output_index, (output, folder) in enumerate(zip(outputs, folders)):
            mine = [r for i, r in records if i == output_index]
            _remove_debris(folder, [r.file for r in mine])
            index = write_index(output.plan, folder)
            if index is not None:
                mine.append(index)
            files = [(r.file, r.size) for r in mine] + (output.then(folder) if output.then is not None else [])
            written.files += [(relative(output.folder, name), size) for name, size in files]
            written.checksums.update({relative(output.folder, r.file): r.sha256 for r in mine})
        return written

    @staticmethod
    def _gather(ray: Any, refs: list[tuple[int, Any]], on_bytes: Callable[[int], None] | None
                ) -> list[tuple[int, ShardRecord]]:
        """Every task's record, in plan order; the first named error cancels the rest and is raised."""
        pending = {ref: position for position, (_, ref) in enumerate(refs)}
        results: dict[int, ShardRecord] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            position = pending.pop(done[0])
            try:
                record = ray.get(done[0])
            except Exception as exc:
                for ref in pending:
                    ray.cancel(ref, force=False)
                for ref in pending:  # wait for them to stop, so nothing writes after we return
                    try:
                        ray.get(ref)
                    except Exception:
                        pass
                raise _unwrapped(exc) from None
            results[position] = record
            if on_bytes is not None:
                on_bytes(record.size)
        return [(refs[position][0], results[position]) for position in range(len(refs))]


def _unwrapped(exc: BaseException) -> BaseException:
    """The named error a task raised (Ray wraps it in a RayTaskError); other failures as they are."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, StepmergeError):
        return cause
    for link in (getattr(exc, "__cause__", None),):
        if isinstance(link, StepmergeError):
            return link
    return exc


def _remove_debris(folder: str, shards: list[str]) -> None:
    """Remove the temp files that workers killed while writing a shard left in ``folder`` (local targets
    only: an object store never shows an unfinished upload)."""
    if not storage.is_local(folder):
        return
    for entry in storage.list_files(folder, recursive=False):
        if any(entry.path.startswith(f".{shard}.tmp-") for shard in shards):
            storage.remove(storage.join(folder, entry.path))
