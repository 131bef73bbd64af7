"""`RangeReader`: random-access reads of one file at any URL, through its backend."""

from __future__ import annotations

import threading

from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage.entries import FileEntry
from merge_engine.storage.schemes import backend_for


_COUNTED = [0]  # every byte RangeReaders of this process returned
_COUNT_LOCK = threading.Lock()


def _count(n: int) -> None:
    with _COUNT_LOCK:
        _COUNTED[0] += n


def bytes_read() -> int:
    """How many bytes the `RangeReader`s of this process have returned so far (all files, all schemes):
    a worker measures what it read itself by the difference around its job."""
    return _COUNTED[0]


class RangeReader:
    """Random-access reads of one file: ``read_into(offset, buffer)`` fills the buffer exactly.

    Local files use ``os.preadv`` (no mmap, so resident memory stays with the caller's buffer);
    remote files use ranged GETs of at most `tuning.REMOTE_READ_CHUNK` bytes, each retried on
    transient faults. ``size`` (from a listing) saves a remote file's HEAD request; a local file's
    ``size`` is always its real one. A missing file, a read past the end,
    or a file shorter than its metadata promised raises `IncompleteCheckpoint`.
    Thread-safe: concurrent ``read_into`` calls on one reader are fine.

    Pinned reads: with ``version`` (a listing's, `FileEntry.version`; then ``size`` is the listed
    one too) every read is of that version or raises `SourceChanged` naming the file: S3 sends
    ``If-Match: <ETag>`` with every ranged GET, GCS reads ``?generation=<listed>`` and checks the
    generation served, a local file must keep its inode, size and mtime (``fstat`` on the open
    descriptor, at open and after every read). So a file replaced or rewritten after it was listed
    can never give bytes of two versions, nor bytes of a version the fingerprint does not name.
    `listed` opens one from its `FileEntry`.
    """

    def __init__(self, url: str, size: int | None = None, version: str | None = None) -> None:
        self.url = url
        self.version = version or None
        self._file = backend_for(url).open_range(url, size, self.version)
        self.size = self._file.size

    @classmethod
    def listed(cls, url: str, entry: FileEntry) -> RangeReader:
        """A reader pinned to the size and version a listing recorded for the file at ``url``."""
        return cls(url, entry.size, entry.version)

    def read_into(self, offset: int, buffer: memoryview | bytearray) -> None:
        buffer = memoryview(buffer).cast("B")
        want = len(buffer)
        if offset < 0 or offset + want > self.size:
            raise IncompleteCheckpoint(
                f"read of {want} bytes at {offset} runs past the end ({self.size} bytes): truncated file",
                self.url,
            )
        done = 0
        while done < want:
            n = self._file.read_some(offset + done, buffer[done:])
            if n <= 0:
                raise IncompleteCheckpoint(f"unexpected end of file at byte {offset + done}", self.url)
            done += n
        _count(want)

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
