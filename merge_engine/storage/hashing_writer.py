"""`HashingWriter`: an all-or-nothing streaming write (`open_write`) that computes the file's sha256 and
size from the bytes as they are written, so the record of a written file costs no second read."""

from __future__ import annotations

import hashlib
from typing import Any

from merge_engine.storage.atomic_writer import CommitOnExit, open_write


class HashingWriter(CommitOnExit):
    """Writes ``url`` through `open_write` (committed on a clean ``with`` exit, aborted on an exception)
    and hashes every byte written: ``size`` and ``sha256()`` once done. Write-only (what ``torch.save``
    and a DCP data file need: ``write``, ``flush``, ``tell``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.size = 0
        self._digest = hashlib.sha256()
        self._out = open_write(url)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._out.write(view)
        self._digest.update(view)  # releases the GIL on large buffers
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._out.flush()

    def tell(self) -> int:
        return self.size

    def sha256(self) -> str:
        return self._digest.hexdigest()

    def close(self) -> None:
        """Commit the file (idempotent)."""
        self._out.close()

    def abort(self) -> None:
        """Throw away what was written (idempotent)."""
        self._out.abort()  # type: ignore[attr-defined]
