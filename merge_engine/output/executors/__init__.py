"""Where work units run: ONE registry of executors, keyed by address. Same units, same bytes, any engine.

A job hands an executor its outputs (`merge_engine.output.work_unit.PlannedOutput`: one folder of the target,
its `WorkUnit`s, then its ``finish`` and ``then`` files). An executor is named by an address
``<scheme>:<rest>`` and made by the factory registered for its scheme (`executor_at`):

- ``threads:N`` (``threads``: one per core): `local.LocalExecutor`, N threads of this process shared out
  between the units and their byte ranges;
- ``ray:auto``, ``ray:local``, ``ray:host:port``, ``ray://host:port`` (Ray Client): `ray.RayExecutor`, one
  Ray task per unit (the optional extra ``stepmerge[ray]``, imported only when asked for);
- a scheme registered by its own module (`register_executor`): ``tasks.shard_runs`` registers
  ``prefect-ray``, Prefect task runs on Ray, when a flow imports it.

`executor_address` is the address the CLI's and the flows' spellings name (``--workers N``,
``--ray-address A``). Adding an executor is its module plus one line in `EXECUTORS`.

Contract of an `Executor`: ``write(job, outputs, url, chunk_bytes=, on_bytes=)`` runs every unit of every
output under the folder URL ``url`` (each output into its ``folder``), then each output's ``finish`` and
``then``, and returns a `WrittenFiles`: (name relative to ``url``, size) per file and the sha256 of every
file a unit or ``finish`` wrote. The first failure stops the other units and is raised once they have
stopped. ``job`` is the `merge_engine.output.jobs.OutputJob` the outputs were prepared from: an executor
running units in other processes prepares it again there (metadata only) and checks it plans the same units.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from merge_engine.errors import InvalidOption
from merge_engine.storage.written import FileRecord
from merge_engine.output.work_unit import Files, PlannedOutput

__all__ = ["EXECUTORS", "Executor", "WrittenFiles", "executor_address", "executor_at", "finish_output",
           "register_executor"]


@dataclass
class WrittenFiles:
    """What an executor wrote: (name, size) per file, and sha256 per file a unit or ``finish`` wrote."""

    files: Files = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)


class Executor(Protocol):
    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles: ...


# scheme -> "module:factory" (imported when first asked for) or the factory itself; factory(rest) -> Executor
EXECUTORS: dict[str, str | Callable[[str], Executor]] = {
    "threads": "merge_engine.output.executors.local:LocalExecutor.at",
    "ray": "merge_engine.output.executors.ray:RayExecutor.at",
}


def register_executor(scheme: str, factory: Callable[[str], Executor]) -> None:
    """Make ``<scheme>:<rest>`` addresses name ``factory(rest)``."""
    EXECUTORS[scheme] = factory


def executor_at(address: str) -> Executor:
    """The executor ``address`` names: ``factory(rest)`` of its scheme, ``rest`` being what follows
    ``<scheme>:`` (the whole address when it is a URL of the scheme, ``ray://host:port``). `InvalidOption`
    for a scheme nobody registered, or a ``rest`` its factory refuses (a Ray address naming no live
    cluster: `RayClusterUnreachable`, within seconds)."""
    scheme, _, rest = address.partition(":")
    factory = EXECUTORS.get(scheme)
    if factory is None:
        raise InvalidOption(f"no executor is registered for {scheme!r}; known: {', '.join(sorted(EXECUTORS))}",
                            address)
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        factory = found
    return factory(address if rest.startswith("//") else rest)  # type: ignore[operator]


def executor_address(workers: int | None = None, ray_address: str | None = None) -> str:
    """The address of the executor the options ask for: Ray when ``ray_address`` is given (``auto``,
    ``local``, ``host:port``, ``ray://host:port``), else ``workers`` threads here (None: one per core)."""
    if ray_address:
        return ray_address if ray_address.startswith("ray://") else f"ray:{ray_address}"
    return "threads" if workers is None else f"threads:{workers}"


def finish_output(written: WrittenFiles, output: PlannedOutput, folder_url: str, records: list[FileRecord]) -> None:
    """Finish ``output`` after its units wrote ``records`` under ``folder_url`` (its ``finish``, then its
    ``then``) and add every file to ``written``, named relative to the executor's target."""
    records = records + (output.finish(records, folder_url) if output.finish is not None else [])
    files = [(r.file, r.size) for r in records] + (output.then(folder_url) if output.then is not None else [])
    written.files += [(_relative(output.folder, name), size) for name, size in files]
    written.checksums.update({_relative(output.folder, r.file): r.sha256 for r in records})


def _relative(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name
