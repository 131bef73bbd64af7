"""An output built for a release: the folder a build wrote to staging, or found already released.

`BuiltOutput` is what the pipeline's build stage hands to validation and publishing (the Prefect tasks
return it as it is: a small frozen record, never a tensor). ``url`` is where its bytes are now: the
staging folder, or the release itself when it was already published (``released``: nothing was built
or read). ``fingerprint`` is the engine's digest of inputs + options + engine version, the one the
release's manifest records. ``attempt`` is unique per build (a rebuild gets a new one, so validation
runs again on new bytes). ``checksums``: the shard jobs' sha256 of every weight file and index, which
publishing checks the copied bytes against.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the job pipeline's result: imported for its type only (it imports torch)
    from merge_engine.output.jobs import OutputResult

__all__ = ["BuiltOutput"]


@dataclass(frozen=True)
class BuiltOutput:
    """A model or adapter folder built for ``release`` (see the module docstring)."""

    kind: str  # MODEL | ADAPTER (`merge_engine.release.folders`)
    source_url: str
    url: str
    fingerprint: str
    release: str = ""  # where this output is (to be) published
    attempt: str = ""
    layout: str = ""
    tensors: int = 0
    tensor_bytes: int = 0
    files: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    released: bool = False
    notes: tuple[str, ...] = ()
    checksums: tuple[tuple[str, str], ...] = ()  # (file, sha256) per weight file and index, from the shard jobs

    @property
    def release_url(self) -> str:
        """The release this output belongs to (its own URL when it was found released)."""
        return self.url if self.released else self.release

    @classmethod
    def from_result(cls, kind: str, result: OutputResult, release: str) -> BuiltOutput:
        """The output a job wrote in staging (`merge_engine.output.jobs.run_job`'s result), for ``release``."""
        return cls(kind=kind, source_url=result.source_url, url=result.target_url, fingerprint=result.fingerprint,
                   release=release, attempt=uuid.uuid4().hex, layout=result.layout, tensors=result.tensors,
                   tensor_bytes=result.tensor_bytes, files=len(result.files),
                   total_bytes=sum(size for _, size in result.files), seconds=result.seconds,
                   notes=tuple(result.notes), checksums=tuple(result.checksums))
