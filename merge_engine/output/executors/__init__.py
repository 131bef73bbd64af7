"""Where work units run: ONE registry of executors, keyed by address. Same units, same bytes, any engine.

A job hands an executor its outputs (`merge_engine.output.work_unit.PlannedOutput`: one folder of the target,
its `WorkUnit`s, then its ``finish`` and ``then`` files). An executor is named by an address
``<scheme>:<rest>`` and made by the factory registered for its scheme (`executor_at`):

- ``threads:N`` (``threads``: one per core): `local.LocalExecutor`, N threads of this process shared out
  between the units and their byte ranges;
- ``ray:auto``, ``ray:local``, ``ray:host:port``, ``ray://host:port`` (Ray Client): `ray.RayExecutor`, one
  Ray task per unit (the optional extra ``stepmerge[ray]``, imported only when asked for);
- a scheme of a layer above, in the registry its caller passes (`executor_at`'s ``executors``): ``tasks.shard_runs``
  adds ``prefect-ray``, Prefect task runs on Ray, in its own literal registry (``TASK_EXECUTORS``).

`EXECUTORS` is a literal, read-only table: nothing registers into it, so which executors exist never depends on
which modules were imported. `executor_address` is the address the CLI's and the flows' spellings name
(``--workers N``, ``--ray-address A``). Adding an executor is its module plus one line in `EXECUTORS`.

Contract of an `Executor` (`contract`): ``write(job, outputs, url, chunk_bytes=, on_bytes=)`` runs every unit of every
output under the folder URL ``url`` (each output into its ``folder``), then each output's ``finish`` and
``then``, and returns a `WrittenFiles`: (name relative to ``url``, size) per file and the sha256 of every
file a unit or ``finish`` wrote. The first failure stops the other units and is raised once they have
stopped. ``job`` is the `merge_engine.output.jobs.OutputJob` the outputs were prepared from: an executor
running units in other processes prepares it again there (metadata only) and checks it plans the same units.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from merge_engine.errors import InvalidOption
from merge_engine.output.executors.contract import Executor, WrittenFiles, finish_output

__all__ = ["EXECUTORS", "Executor", "ExecutorFactory", "WrittenFiles", "executor_address", "executor_at",
           "finish_output"]

ExecutorFactory = Callable[[str], Executor]
"""What a scheme names: ``factory(rest)`` -> the `Executor` of ``<scheme>:<rest>``."""


def _threads(rest: str) -> Executor:
    from merge_engine.output.executors.local import LocalExecutor

    return LocalExecutor.at(rest)


def _ray(rest: str) -> Executor:
    from merge_engine.output.executors.ray import RayExecutor  # the optional extra: imported only when asked for

    return RayExecutor.at(rest)


EXECUTORS: Mapping[str, ExecutorFactory] = MappingProxyType({
    "threads": _threads,
    "ray": _ray,
})
"""The engine's executors, scheme -> factory; read-only (a layer above passes its own table to `executor_at`)."""


def executor_at(address: str, executors: Mapping[str, ExecutorFactory] = EXECUTORS) -> Executor:
    """The executor ``address`` names: ``factory(rest)`` of its scheme in ``executors`` (default: the engine's
    `EXECUTORS`), ``rest`` being what follows ``<scheme>:`` (the whole address when it is a URL of the scheme,
    ``ray://host:port``). `InvalidOption` for a scheme ``executors`` does not hold, or a ``rest`` its factory
    refuses (a Ray address naming no live cluster: `RayClusterUnreachable`, within seconds)."""
    scheme, _, rest = address.partition(":")
    factory = executors.get(scheme)
    if factory is None:
        raise InvalidOption(f"no executor is registered for {scheme!r}; known: {', '.join(sorted(executors))}",
                            address)
    return factory(address if rest.startswith("//") else rest)


def executor_address(workers: int | None = None, ray_address: str | None = None) -> str:
    """The address of the executor the options ask for: Ray when ``ray_address`` is given (``auto``,
    ``local``, ``host:port``, ``ray://host:port``), else ``workers`` threads here (None: one per core)."""
    if ray_address:
        return ray_address if ray_address.startswith("ray://") else f"ray:{ray_address}"
    return "threads" if workers is None else f"threads:{workers}"

