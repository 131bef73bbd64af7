"""Work units as tasks of a Ray cluster (the optional extra ``ray``: ``pip install -c constraints.txt '.[ray]'``
from the checkout). Addresses: ``ray:auto``, ``ray:local``, ``ray:host:port``, ``ray://host:port``.

Each work unit (a shard, a rank file) is one Ray task running `merge_engine.output.executors.remote.run_unit_task`
on a worker: it reads straight from the checkpoint's storage and writes straight to the target URL. No
weight byte passes through the coordinator or Ray's object store: only `FileRecord`s come back.

- Retries: a task whose worker dies (node lost, OOM-killed, SIGKILL) is run again by Ray
  (``max_retries``); the unit's file is written whole again (a unit is atomic per file). A named error
  (a truncated rank file, ...) is not retried: the first one cancels the other tasks and is raised once
  they have stopped. An interrupt (`merge_engine.output.interrupts`) cancels every task the same way.
- The storage settings of the coordinator (`remote.storage_env`) travel inside every task (`UnitTask.env`,
  applied by the worker), not as a Ray ``runtime_env``: a runtime env of its own would make Ray start (and
  import torch in) fresh worker processes for every merge instead of reusing the idle ones.
- Where each task ran: `RayExecutor.task_runs` holds a `TaskRun` (node id, pid, source bytes read) per
  unit of the last `run_all`, in the order of the tasks (the attempt that succeeded).
- Start: `RayExecutor.at` (the CLI's ``--ray-address``) connects in a thread of its own while this process
  checks and plans, and has each CPU of the cluster (up to `WARM_WORKERS`, spread over the nodes) start a
  worker that imports the shard job (`warm_worker`): Ray's driver connection and its workers' start (Python,
  Ray, torch) then overlap the preparation instead of following it. Ray reuses those
  idle workers for the job's unit tasks. `run_all` waits for the connection; its failure is raised there.
- Every core on every shard: a job with fewer unit tasks than the cluster has CPUs gives each task its share
  of them (`threads_per_task`: at most a node's CPUs), and the task writes its byte ranges on that many
  threads (a one-shard merge on a 2-CPU node: one task, 2 CPUs, 2 threads).
- ``address``: "auto" (a cluster started with ``ray start``), ``host:port``, ``ray://host:port`` (Ray
  Client), or "local" (a private cluster of this machine). A ``host:port`` that answers nothing, or not as
  Ray does, is `RayClusterUnreachable` within seconds (`ray_address.check_ray_address`), never Ray's own
  minutes of retries. When this process is already connected to Ray, that connection is used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from merge_engine.errors import InvalidOption, RayClusterUnreachable, StepmergeError
from merge_engine.storage.written import FileRecord
from merge_engine.output import interrupts
from merge_engine.output.executors.ray_address import check_ray_address
from merge_engine.output.executors.remote import RemoteExecutor, UnitTask, run_unit_task, storage_env
from merge_engine.storage.range_reader import bytes_read

__all__ = ["DEFAULT_MAX_RETRIES", "RayExecutor", "TaskRun", "threads_per_task"]

DEFAULT_MAX_RETRIES = 3
POLL_S = 0.2  # how often the coordinator looks for an interrupt while it waits for tasks
SETTLE_S = 1.0  # how long the other tasks get to end on their own before they are cancelled (`_stop`)
WARM_WORKERS = 8  # at most this many workers are started ahead of the tasks
_INIT_LOCK = threading.Lock()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidOption("--ray-address needs Ray: pip install -c constraints.txt '.[ray]' "
                            "(from the stepmerge checkout)") from None
    return ray


@dataclass(frozen=True)
class TaskRun:
    """Where one unit's task ran: the Ray node id and worker pid, and the bytes that worker read from the
    checkpoint's storage for it (its own reads: `merge_engine.storage.range_reader.bytes_read`)."""

    node_id: str
    pid: int
    source_bytes: int


def run_ray_unit_task(task: UnitTask) -> tuple[FileRecord, TaskRun]:
    """`run_unit_task` on a Ray worker; its record and where it ran."""
    import ray

    before = bytes_read()
    record = run_unit_task(task)
    return record, TaskRun(ray.get_runtime_context().get_node_id(), os.getpid(), bytes_read() - before)


def warm_worker() -> TaskRun:
    """A worker's start, ahead of the tasks: the shard job's modules imported (torch among them); where it ran."""
    import ray

    import merge_engine.output.executors.remote  # noqa: F401 - the task's body
    import merge_engine.output.shard_job  # noqa: F401 - the write (torch)
    import merge_engine.planner  # noqa: F401 - the job's re-preparation

    return TaskRun(ray.get_runtime_context().get_node_id(), os.getpid(), 0)


class _NotMainThread(logging.Filter):
    """Ray's driver says that it set no SIGTERM handler when connected from a thread: by design here
    (`interrupts.reclaim_signals` owns the signals)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class RayExecutor(RemoteExecutor):
    """Work units as Ray tasks (see the module docstring)."""

    def __init__(self, address: str | None = "auto", *, max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        self.address = address
        self.max_retries = max_retries
        self.task_runs: list[TaskRun] = []
        self.warm_ups: list[Any] = []  # refs of the `warm_worker` tasks started ahead (each gives where it ran)
        self._connecting: threading.Thread | None = None
        self._connect_error: BaseException | None = None

    @classmethod
    def at(cls, rest: str) -> RayExecutor:
        """``ray:<address>`` / ``ray://host:port``: a Ray address that names no live cluster is refused here,
        within seconds, before anything is read (`ray_address.check_ray_address`); then the connection and
        the workers' start begin in the background (`start_connecting`)."""
        executor = cls(rest or "auto")
        executor.check_address()
        executor.start_connecting()
        return executor

    def start_connecting(self) -> None:
        """Connect and start the workers (`warm_worker`) in a thread of its own; `run_all` waits for it."""
        def connect() -> None:
            quiet = _NotMainThread()
            logging.getLogger("ray._private.worker").addFilter(quiet)
            try:
                ray = self._init()
                cpus = int(ray.cluster_resources().get("CPU", 0))
                warm = ray.remote(warm_worker).options(num_cpus=1, name="stepmerge-warm-up",
                                                       scheduling_strategy="SPREAD")  # every node, not the first
                self.warm_ups = [warm.remote() for _ in range(min(cpus, WARM_WORKERS))]  # not waited for
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread, by `_connect`
                self._connect_error = exc
            finally:
                logging.getLogger("ray._private.worker").removeFilter(quiet)

        if self._connecting is None and not import_ray().is_initialized():
            self._connecting = threading.Thread(target=connect, name="stepmerge-ray-connect", daemon=True)
            self._connecting.start()

    def check_address(self) -> None:
        """`InvalidOption` / `RayClusterUnreachable` within seconds for an address that is no live Ray cluster."""
        check_ray_address(self.address)

    def _init(self) -> Any:
        ray = import_ray()
        with _INIT_LOCK:  # two executors connecting at once (a flow's threads) connect once
            return self._init_once(ray)

    def _init_once(self, ray: Any) -> Any:
        if not ray.is_initialized():
            self.check_address()
            try:
                if self.address in (None, "", "local"):
                    ray.init(log_to_driver=False, include_dashboard=False, configure_logging=False)
                else:
                    ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            except ConnectionError as exc:  # "auto" with no cluster on this machine, a cluster gone meanwhile
                raise RayClusterUnreachable(f"no Ray cluster at the --ray-address: {exc}".splitlines()[0],
                                            self.address) from None
        return ray

    def _connect(self) -> Any:
        if self._connecting is not None:
            self._connecting.join()
            self._connecting = None
            if self._connect_error is not None:
                error, self._connect_error = self._connect_error, None
                raise error
        ray = self._init()
        interrupts.reclaim_signals()  # Ray's driver aborts on SIGTERM: the unit tasks must be stopped first
        return ray

    def run_all(self, tasks: list[UnitTask], on_record: Callable[[FileRecord], None]) -> list[FileRecord]:
        ray = self._connect()
        threads = threads_per_task([node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]],
                                   len(tasks))
        remote = _remote_task(ray).options(max_retries=self.max_retries, retry_exceptions=False, num_cpus=threads,
                                           name="stepmerge-shard")
        env = tuple(storage_env().items())
        refs: list[Any] = []
        records: dict[int, FileRecord] = {}
        runs: dict[int, TaskRun] = {}
        try:
            for task in tasks:
                refs.append(remote.remote(replace(task, env=env, threads=threads)))
            pending = {ref: position for position, ref in enumerate(refs)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                if not done:
                    interrupts.check()  # a signal: stop every task (below), then raise it
                    continue
                position = pending.pop(done[0])
                try:
                    records[position], runs[position] = ray.get(done[0])
                except Exception as exc:
                    raise _named(exc) from None
                on_record(records[position])
        except BaseException:  # a task failed, or an interrupt: nothing writes after we return
            _stop(ray, [ref for position, ref in enumerate(refs) if position not in records])
            raise
        self.task_runs = [runs[position] for position in range(len(tasks))]
        return [records[position] for position in range(len(tasks))]


def threads_per_task(node_cpus: list[float], tasks: int) -> int:
    """The CPUs (and threads) each of ``tasks`` unit tasks takes on a cluster whose live nodes have ``node_cpus``:
    the cluster's CPUs shared out between the tasks, at most the CPUs of its largest node, at least 1."""
    whole = [int(cpus) for cpus in node_cpus]
    return max(1, min(max(whole, default=1), sum(whole) // max(tasks, 1)))


_REMOTE: dict[int, Any] = {}  # id(ray module) -> the remote function, made once per process


def _remote_task(ray: Any) -> Any:
    """`run_ray_unit_task` as a Ray remote function: defined once, so that Ray exports it once per
    cluster connection, not once per merge."""
    remote = _REMOTE.get(id(ray))
    if remote is None:
        remote = _REMOTE[id(ray)] = ray.remote(run_ray_unit_task)
    return remote


def _stop(ray: Any, refs: list[Any]) -> None:
    """Cancel ``refs`` and wait until each has stopped (a second interrupt does not cut the wait short).

    A task that ends on its own within `SETTLE_S` (a sibling of the first failure, failing on the same cause) is
    not cancelled: Ray's driver aborts the whole process when a cancel crosses the task's own reply ("Check failed:
    ... Tried to complete task that was not pending", Ray 2.60; ray-project/ray#54846), and a failure's siblings
    reply at that very moment."""
    running = list(refs)
    try:
        if running:
            _, running = ray.wait(running, num_returns=len(running), timeout=SETTLE_S)
    except KeyboardInterrupt:  # a second interrupt: cancel them all now
        pass
    for ref in running:
        ray.cancel(ref)
    for ref in refs:
        while True:
            try:
                ray.get(ref)
            except KeyboardInterrupt:
                continue
            except Exception:  # cancelled or failed: either way it has stopped
                pass
            break


def _named(exc: BaseException) -> BaseException:
    """The named error a task raised (Ray wraps it in a RayTaskError); any other failure as it is."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, StepmergeError) else exc
