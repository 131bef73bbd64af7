"""THE unit of work: one output file, written whole by one call, from anywhere, with the same bytes.

Every command's output is a list of `PlannedOutput`s (one folder of the target each), and each is a list of
`WorkUnit`s: a merge's safetensors shard (`merge_engine.output.shard_unit.ShardUnit`) or a file ``stepmerge
split`` writes (`merge_engine.commands.split.LayoutFileUnit`: a Megatron rank file, a DCP data file). An
executor (`merge_engine.output.executors`) runs the units, here or on a cluster, then the output's
``finish`` and ``then``. Nothing in an executor knows which kind of unit it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from merge_engine.storage.written import FileRecord

if TYPE_CHECKING:
    from merge_engine.plan.merge_plan import MergePlan

__all__ = ["Files", "PlannedOutput", "WorkUnit"]

Files = list[tuple[str, int]]  # written file names (relative to the folder they were written in) with sizes


class WorkUnit(Protocol):
    """One output file, planned from metadata alone. Contract:

    - ``planned``: (file relative to the output folder, bytes planned or -1 when not known before it is
      written, tensor names): what a worker that planned the same job again must find at the same place.
    - ``run(folder_url, cancel, *, chunk_bytes, threads, on_bytes)``: writes the file under ``folder_url``
      atomically (`merge_engine.storage.open_write`: a failure leaves no file under its name), hashing
      while writing (`merge_engine.storage.hashing_writer.HashingWriter`); its `FileRecord`. Its bytes
      depend on the unit alone: never on the process, the order, ``threads`` or ``chunk_bytes``.
      ``cancel`` (an Event, or None) is checked between chunks: once set, the unit raises
      `merge_engine.storage.written.WriteCancelled` and leaves no file. ``threads``: how many threads it
      may use on its own byte ranges (a unit that cannot be cut uses one); ``on_bytes``: progress, in
      bytes, from the threads running it.
    """

    @property
    def planned(self) -> tuple[str, int, tuple[str, ...]]: ...

    def run(self, folder_url: str, cancel: threading.Event | None = None, *, chunk_bytes: int, threads: int = 1,
            on_bytes: Callable[[int], None] | None = None) -> FileRecord: ...


@dataclass
class PlannedOutput:
    """One folder of a job's output (``folder`` of the target, "" for the target itself): its ``units``, then
    ``finish(records, folder_url)`` (what needs every unit's record, in the order of ``units``: a
    safetensors index, a DCP ``.metadata``; its records), then ``then(folder_url)`` (the folder's other
    files: config, tokenizer, adapter config). ``plan``: the `MergePlan` the units write, when they are
    safetensors shards (progress and counts)."""

    units: Sequence[WorkUnit]
    folder: str = ""
    finish: Callable[[list[FileRecord], str], list[FileRecord]] | None = None
    then: Callable[[str], Files] | None = None
    plan: MergePlan | None = None
