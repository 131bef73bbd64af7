"""`HashingWriter`: THE hashing writer. An all-or-nothing streaming write (`open_write`) that computes the file's
sha256 and size from the bytes as they are written, so the record of a written file costs no second read.

Every file a work unit writes goes through it: a merge's safetensors shards (`write_shard`, hashing in a
thread of its own: sha256 costs as much as the read, cast and write together, so it must not be the
writer's thread: docs/scaling.md, "Figures behind the engine's choices") and ``split``'s rank and DCP data files (``torch.save`` into it, hashed inline).
"""

from __future__ import annotations

import hashlib
import queue
import threading
from typing import Any

from merge_engine.storage.atomic_writer import CommitOnExit, open_write

__all__ = ["HashingWriter"]


class HashingWriter(CommitOnExit):
    """Writes ``url`` through `open_write` (committed on a clean ``with`` exit, aborted on an exception)
    and hashes every byte written: ``size`` and ``sha256()`` once done. Write-only (what ``torch.save``,
    a DCP data file and a shard job need: ``write``, ``flush``, ``tell``).

    ``size_hint``: the file's final size when known (a local file is preallocated). ``hash_queue`` > 0:
    sha256 runs in a thread of its own (it releases the GIL on large buffers) with up to ``hash_queue``
    written buffers waiting for it; `write` then hands its buffer over (it must not change afterwards)
    and blocks only while that many wait. 0: hashed in `write` itself.
    """

    _DONE = object()

    def __init__(self, url: str, *, size_hint: int | None = None, hash_queue: int = 0) -> None:
        self.url = url
        self.size = 0
        self._digest = hashlib.sha256()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if hash_queue > 0:
            self._queue = queue.Queue(maxsize=hash_queue)
            self._thread = threading.Thread(target=self._hash, name="stepmerge-hasher", daemon=True)
            self._thread.start()
        try:
            self._out = open_write(url, size_hint=size_hint)
        except BaseException:
            self._stop_hashing()
            raise

    def _hash(self) -> None:
        assert self._queue is not None
        while (data := self._queue.get()) is not self._DONE:
            self._digest.update(data)  # releases the GIL on large buffers

    def _stop_hashing(self) -> None:
        """Wait until every buffer handed over is hashed, then stop the thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive() and self._queue is not None:
            self._queue.put(self._DONE)  # the thread never stops early: the put always completes
            self._thread.join()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._out.write(view)
        if self._queue is not None:
            self._queue.put(view)
        else:
            self._digest.update(view)  # releases the GIL on large buffers
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._out.flush()

    def tell(self) -> int:
        return self.size

    def sha256(self) -> str:
        """The hex sha256 of every byte written (waits for the hashing thread)."""
        self._stop_hashing()
        return self._digest.hexdigest()

    def close(self) -> None:
        """Commit the file (idempotent)."""
        try:
            self._out.close()
        finally:
            self._stop_hashing()

    def abort(self) -> None:
        """Throw away what was written (idempotent)."""
        try:
            self._out.abort()
        finally:
            self._stop_hashing()
