"""What an executor is (`Executor`) and what it hands back (`WrittenFiles`), below the executors themselves: the
registry (`merge_engine.output.executors`) and each executor module import it, and it imports none of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from merge_engine.storage.written import FileRecord
from merge_engine.output.work_unit import Files, PlannedOutput

__all__ = ["Executor", "WrittenFiles", "finish_output"]


@dataclass
class WrittenFiles:
    """What an executor wrote: (name, size) per file, and sha256 per file a unit or ``finish`` wrote."""

    files: Files = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)


class Executor(Protocol):
    def write(self, job: Any, outputs: Sequence[PlannedOutput], url: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None) -> WrittenFiles: ...


def finish_output(written: WrittenFiles, output: PlannedOutput, folder_url: str, records: list[FileRecord]) -> None:
    """Finish ``output`` after its units wrote ``records`` under ``folder_url`` (its ``finish``, then its
    ``then``) and add every file to ``written``, named relative to the executor's target."""
    records = records + (output.finish(records, folder_url) if output.finish is not None else [])
    files = [(r.file, r.size) for r in records] + (output.then(folder_url) if output.then is not None else [])
    written.files += [(_relative(output.folder, name), size) for name, size in files]
    written.checksums.update({_relative(output.folder, r.file): r.sha256 for r in records})


def _relative(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name
