"""Shard jobs as tasks of a Ray cluster (the optional extra ``ray``: ``pip install -c constraints.txt '.[ray]'``
from the checkout).

Each shard job is one Ray task running `merge_engine.executors.remote.run_shard_task` on a worker: it
reads straight from the checkpoint's storage and writes straight to the target URL. No weight byte passes
through the coordinator or Ray's object store: only `ShardRecord`s come back.

- Retries: a task whose worker dies (node lost, OOM-killed, SIGKILL) is run again by Ray
  (``max_retries``); the shard is written whole again (`write_shard` is atomic per file). A named error
  (a truncated rank file, ...) is not retried: the first one cancels the other tasks and is raised once
  they have stopped. An interrupt (`merge_engine.interrupts`) cancels every task the same way.
- The storage settings of the coordinator (`remote.storage_env`) travel with every task (``runtime_env``).
- ``address``: "auto" (a cluster started with ``ray start``), ``host:port``, ``ray://host:port`` (Ray
  Client), or "local" (a private cluster of this machine). When this process is already connected to Ray,
  that connection is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from merge_engine import interrupts
from merge_engine.errors import InvalidOption, StepmergeError
from merge_engine.executors.remote import RemoteExecutor, ShardTask, run_shard_task, storage_env
from merge_engine.shard_job import ShardRecord

__all__ = ["DEFAULT_MAX_RETRIES", "RayExecutor"]

DEFAULT_MAX_RETRIES = 3
POLL_S = 0.2  # how often the coordinator looks for an interrupt while it waits for tasks


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidOption("--ray-address needs Ray: pip install -c constraints.txt '.[ray]' "
                            "(from the stepmerge checkout)") from None
    return ray


class RayExecutor(RemoteExecutor):
    """Shard jobs as Ray tasks (see the module docstring)."""

    def __init__(self, address: str | None = "auto", *, max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        self.address = address
        self.max_retries = max_retries

    def _connect(self) -> Any:
        ray = import_ray()
        if not ray.is_initialized():
            if self.address in (None, "", "local"):
                ray.init(log_to_driver=False, include_dashboard=False, configure_logging=False)
            else:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            interrupts.reclaim_signals()  # Ray's driver aborts on SIGTERM: the shard tasks must be stopped first
        return ray

    def run_all(self, tasks: list[ShardTask], on_record: Callable[[ShardRecord], None]) -> list[ShardRecord]:
        ray = self._connect()
        remote = ray.remote(run_shard_task).options(
            max_retries=self.max_retries, retry_exceptions=False, num_cpus=1, name="stepmerge-shard",
            runtime_env={"env_vars": storage_env()})
        refs: list[Any] = []
        records: dict[int, ShardRecord] = {}
        try:
            for task in tasks:
                refs.append(remote.remote(task))
            pending = {ref: position for position, ref in enumerate(refs)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                if not done:
                    interrupts.check()  # a signal: stop every task (below), then raise it
                    continue
                position = pending.pop(done[0])
                try:
                    records[position] = ray.get(done[0])
                except Exception as exc:
                    raise _named(exc) from None
                on_record(records[position])
        except BaseException:  # a task failed, or an interrupt: nothing writes after we return
            _stop(ray, [ref for position, ref in enumerate(refs) if position not in records])
            raise
        return [records[position] for position in range(len(tasks))]


def _stop(ray: Any, refs: list[Any]) -> None:
    """Cancel ``refs`` and wait until each has stopped (a second interrupt does not cut the wait short)."""
    for ref in refs:
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
