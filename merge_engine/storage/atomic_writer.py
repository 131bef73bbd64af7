"""`AtomicWriter` / `open_write`: streaming writes to any URL that appear whole or not at all; `open_parts`:
the same promise for a file written in numbered parts, in any order, where the store allows it."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from merge_engine.storage.backend import PartsUpload
from merge_engine.storage.schemes import backend_for


class CommitOnExit:
    """``with`` protocol of an all-or-nothing writer: a clean exit commits (``close()``), leaving by an
    exception throws the writing away (``abort()``)."""

    def __enter__(self):
        return self

    if TYPE_CHECKING:  # each writer defines both (declared here for the type checker, never in the MRO)
        def close(self) -> None:
            """Commit what was written (all or nothing)."""

        def abort(self) -> None:
            """Throw what was written away."""

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class AtomicWriter(CommitOnExit, io.RawIOBase):
    """A streaming binary writer whose file appears whole or not at all.

    ``close()`` commits: a local temp file is fsynced and renamed onto the target; a remote
    upload (an S3 multipart upload, a GCS resumable upload) is completed. ``abort()`` throws
    everything away. Leaving a ``with`` block by an exception aborts, and so does garbage
    collection of a writer never closed: an unfinished file is never published.
    """

    def __init__(self, url: str, block_size: int | None = None, size_hint: int | None = None) -> None:
        super().__init__()
        self.url = url
        self._done = False
        self._written = 0
        self._upload = backend_for(url).open_upload(url, block_size, size_hint)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._done:
            raise ValueError("write to a closed writer")
        n = memoryview(data).nbytes
        self._upload.write(data)
        self._written += n
        return n

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        if not self._done:
            self._upload.flush()

    def close(self) -> None:
        """Commit (idempotent). On a failed commit, the partial upload is discarded and the error raised."""
        if self._done:
            return
        self._done = True
        try:
            self._upload.commit()
        except BaseException:
            self._upload.discard()
            raise
        finally:
            super().close()

    def abort(self) -> None:
        """Throw away what was written; the target is left as it was. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self._upload.discard()
        finally:
            super().close()


    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:
            pass


def open_write(url: str, block_size: int | None = None, size_hint: int | None = None) -> AtomicWriter:
    """A streaming binary writer (`AtomicWriter`); parent folders are created for local paths.

    ``block_size`` is the remote part size (S3 parts must be >= 5 MiB; default 50 MiB on S3);
    ``size_hint``, the final size when known, preallocates a local file.
    """
    return AtomicWriter(url, block_size=block_size, size_hint=size_hint)


def open_parts(url: str, size: int, part_bytes: int) -> PartsUpload | None:
    """``url`` (``size`` bytes) written as numbered parts, in any order, from several threads (local:
    positioned writes into one temp file; S3: a multipart upload's parts by number); None where the
    store takes a file's bytes only in order (GCS, memory): write those through `open_write`. The
    caller commits once every part is written, or discards (nothing appears)."""
    return backend_for(url).open_parts(url, size, part_bytes)
