"""A job's work units as Prefect task runs on a Ray cluster (`prefect-ray`'s ``RayTaskRunner``): the executor
``prefect-ray:<ray address>`` of the tasks' registry, `TASK_EXECUTORS`: the engine's (`merge_engine.output.executors`)
plus this one, a literal table that a task passes to `merge_engine.output.executors.executor_at`.

`PrefectRayExecutor` is the engine's `merge_engine.output.executors.remote.RemoteExecutor` with Prefect in
charge: its `run_all` runs a small subflow, ``write-shards``, with a ``RayTaskRunner(address)``, that
submits one ``write-shard`` task run per unit (an output shard, a rank file), named after the step and the
unit's file (``global_step_40/actor: model-00003-of-00012.safetensors``), so each is a task run in the UI
with its own state and retries. Each task calls `merge_engine.output.executors.remote.run_unit_task` on a
Ray worker: it reads straight from the checkpoint's storage and writes straight to the target URL; only
the small `merge_engine.storage.written.FileRecord` (file, size, sha256, tensor names) comes back to the
driver, never a tensor. The engine itself never imports Prefect: this module plugs into it.

- Retries: a unit's task retries transient storage faults only (`tasks.retry.RETRY_OPTIONS`); Ray runs a
  task again when its worker dies (``max_retries``), and the file is written whole again. A named error
  (a truncated rank file, ...) fails its task at once: the other tasks are cancelled and waited for, the
  subflow fails with that error, and `merge_engine.output.jobs.run_job` leaves the target absent.
- Workers get the coordinator's storage settings (`remote.storage_env`: endpoints, credentials,
  timeouts) through Ray's ``runtime_env``; the Prefect API settings travel in the task runs' context.
- ``address``: ``auto`` (the cluster this machine joined with ``ray start``), ``host:port``,
  ``ray://host:port`` (Ray Client), or ``local`` (a private cluster of this machine for this merge). A
  process already connected to Ray uses that connection.

Ray and prefect-ray are the optional extra ``stepmerge[ray]``: imported only when a merge asks for Ray.
`task_executor_address` is the address of a task's executor: this one when a Ray address is configured
(the flow parameter, else ``STEPMERGE_RAY_ADDRESS`` in the worker's environment), else this machine's threads;
`task_executor` is that executor, made from `TASK_EXECUTORS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Optional

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from merge_engine.errors import InvalidOption
from merge_engine.storage.written import FileRecord
from merge_engine.layouts.runs import from_step_folder
from merge_engine.output.executors import EXECUTORS, Executor, ExecutorFactory, executor_address, executor_at
from merge_engine.output.executors.ray_address import check_ray_address
from merge_engine.output.executors.remote import RemoteExecutor, UnitTask, run_unit_task, storage_env
from tasks.retry import RETRY_OPTIONS

__all__ = ["PREFECT_RAY", "RAY_ADDRESS_ENV", "TASK_EXECUTORS", "PrefectRayExecutor", "configured_ray_address",
           "ray_task_runner", "task_executor", "task_executor_address", "unit_run_name", "write_unit_run"]

PREFECT_RAY = "prefect-ray"  # its scheme in `TASK_EXECUTORS`
RAY_ADDRESS_ENV = "STEPMERGE_RAY_ADDRESS"
RAY_MAX_RETRIES = 3  # runs of a shard whose Ray worker died (node lost, OOM-killed)


@task(name="write-shard", cache_policy=NO_CACHE, persist_result=False, **RETRY_OPTIONS)
def write_unit_run(unit: UnitTask) -> FileRecord:
    """Write one work unit (on a Ray worker): its record, never its bytes."""
    return run_unit_task(unit)


def unit_run_name(label: str, unit: UnitTask) -> str:
    return f"{label}: {unit.file}"


def ray_task_runner(address: str) -> Any:
    """``RayTaskRunner`` for ``address`` (see the module docstring); `InvalidOption` without the extra,
    `RayClusterUnreachable` when nothing that speaks Ray's protocol answers there (`check_ray_address`)."""
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise InvalidOption(f"ray_address {address!r} needs Ray: pip install -c constraints.txt '.[ray]' "
                            "(from the stepmerge checkout)") from None
    check_ray_address(address)  # a dead or wrong address: a named error now, not Ray's minutes of retries
    init_kwargs = {"log_to_driver": False, "configure_logging": False}
    if address == "local":
        return RayTaskRunner(init_kwargs=init_kwargs)
    if address == "auto":  # RayTaskRunner reads a bare "auto" as "start a local cluster"
        return RayTaskRunner(init_kwargs={**init_kwargs, "address": "auto"})
    return RayTaskRunner(address=address, init_kwargs=init_kwargs)


class PrefectRayExecutor(RemoteExecutor):
    """Work units as Prefect task runs on a Ray cluster (see the module docstring). ``label`` names the runs;
    None: the job's source URL from its step folder on (``global_step_40/actor``, `from_step_folder`)."""

    def __init__(self, address: str, label: str | None = None, *, max_retries: int = RAY_MAX_RETRIES) -> None:
        self.address = address
        self.label = label
        self.max_retries = max_retries

    def run_all(self, tasks: list[UnitTask], on_record: Callable[[FileRecord], None]) -> list[FileRecord]:
        runner = ray_task_runner(self.address)
        label = self.label or (from_step_folder(tasks[0].job.source_url) if tasks else "units")
        max_retries = self.max_retries

        @flow(name="write-shards", flow_run_name=f"write-shards {label}", task_runner=runner,
              validate_parameters=False, persist_result=False, log_prints=True)
        def write_shards(step: str, ray_address: str, files: list[str]) -> list[FileRecord]:
            """One task run per unit on the Ray cluster; records in the order of the units."""
            return _run_unit_tasks(tasks, label, max_retries, on_record)

        return write_shards(label, self.address, [t.file for t in tasks])


TASK_EXECUTORS: Mapping[str, ExecutorFactory] = MappingProxyType({**EXECUTORS, PREFECT_RAY: PrefectRayExecutor})
"""The executors a task's units may run on: the engine's, and Prefect task runs on Ray (read-only)."""


def _run_unit_tasks(tasks: list[UnitTask], label: str, max_retries: int,
                    on_record: Callable[[FileRecord], None]) -> list[FileRecord]:
    import ray
    from prefect.futures import as_completed
    from prefect_ray.context import remote_options
    from prefect_ray.task_runners import PrefectRayFuture

    env = storage_env()
    options: dict[str, Any] = {"max_retries": max_retries, "num_cpus": 1}
    if env:
        options["runtime_env"] = {"env_vars": env}
    with remote_options(**options):
        futures = [write_unit_run.with_options(task_run_name=unit_run_name(label, unit)).submit(unit)
                   for unit in tasks]
    records: dict[Any, FileRecord] = {}
    try:
        for future in as_completed(futures):
            record = future.result()  # raises the task's error (a named one as it is)
            records[future.task_run_id] = record
            on_record(record)
    except BaseException:
        # the Ray task runner's futures: each wraps the Ray object of its task run
        pending = [f.wrapped_future for f in futures
                   if f.task_run_id not in records and isinstance(f, PrefectRayFuture)]
        for ref in pending:
            ray.cancel(ref)
        for ref in pending:  # wait until they have stopped: nothing writes after the merge fails
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - cancelled or failed: either way it has stopped
                pass
        raise
    return [records[f.task_run_id] for f in futures]


def configured_ray_address(ray_address: Optional[str]) -> Optional[str]:
    """The Ray cluster a merge task uses: ``ray_address``, else ``STEPMERGE_RAY_ADDRESS``, else None."""
    return ray_address or os.environ.get(RAY_ADDRESS_ENV) or None


def task_executor_address(workers: Optional[int], ray_address: Optional[str]) -> str:
    """The executor address of a task's units (`merge_engine.output.executors.executor_at`): Prefect task
    runs on Ray (``prefect-ray:<address>``) when an address is configured (`configured_ray_address`), else
    ``workers`` threads of this process (None: one per core)."""
    address = configured_ray_address(ray_address)
    return f"{PREFECT_RAY}:{address}" if address else executor_address(workers)


def task_executor(workers: Optional[int], ray_address: Optional[str]) -> Executor:
    """The executor of a task's units, at `task_executor_address` in `TASK_EXECUTORS`; `InvalidOption` (or
    `RayClusterUnreachable`) as `merge_engine.output.executors.executor_at` refuses an address."""
    return executor_at(task_executor_address(workers, ray_address), TASK_EXECUTORS)
