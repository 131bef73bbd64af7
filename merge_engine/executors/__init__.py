"""Where shard jobs run. Same plans, same bytes, different engines.

- `local.LocalExecutor`: this process, ``workers`` shard jobs at once on threads (`merge_engine.writer`).
- `ray.RayExecutor`: a Ray cluster (the optional extra ``stepmerge[ray]``): each shard job is a Ray task
  that reads straight from the checkpoint's storage and writes straight to the target URL; only small
  `ShardRecord`s come back.

Contract of a `ShardExecutor`: ``write(job, outputs, url, chunk_bytes=, on_bytes=)`` writes every
`PlannedOutput` of ``job`` under the folder URL ``url`` (each output's shards, its index, then its
``then`` files) and returns a `WrittenFiles`: (name relative to ``url``, size) per file and the sha256 of
every weight file and index it wrote. ``job`` is the `merge_engine.jobs.OutputJob` the outputs were
prepared from: an executor that runs shard jobs in other processes prepares it again there
(metadata only) and checks that it gets the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from merge_engine.merge_plan import MergePlan
from merge_engine.tensor_source import TensorSource

Files = list[tuple[str, int]]

__all__ = ["Files", "PlannedOutput", "ShardExecutor", "WrittenFiles", "executor_for"]


@dataclass
class PlannedOutput:
    """One safetensors folder of a job: ``plan`` over ``source``, written into ``folder`` of the target
    ("" for the target itself); ``then(url)`` writes that folder's other files right after its shards."""

    plan: MergePlan
    source: TensorSource
    folder: str = ""
    then: Callable[[str], Files] | None = None


@dataclass
class WrittenFiles:
    """What an executor wrote: (name, size) per file, and sha256 per weight file and index."""

    files: Files = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)


class ShardExecutor(Protocol):
    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles: ...


def executor_for(workers: int | None = None, ray_address: str | None = None) -> ShardExecutor:
    """The executor the options ask for: Ray when ``ray_address`` is given, else this machine's threads
    (``workers`` at once; None: one per core, at most one per shard)."""
    if ray_address:
        from merge_engine.executors.ray import RayExecutor  # optional extra: imported only when asked for

        return RayExecutor(ray_address)
    from merge_engine.executors.local import LocalExecutor

    return LocalExecutor(workers)
