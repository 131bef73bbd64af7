"""Sequential file writes that bypass the page cache (``O_DIRECT``), for multi-GB weight files.

Why: a merge writes as many bytes as the model holds; through the page cache those writes stall on
reclaim and end in a long ``fsync`` (figures: docs/scaling.md, "Figures behind the engine's choices"),
and they evict the reader's cache. `DirectFile` hides the rules
``O_DIRECT`` imposes (aligned buffer, block-multiple sizes): bytes are staged in one aligned
buffer, written in full blocks, and the tail is padded then truncated away. Where the
filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems), the same object falls back
to ordinary buffered writes before its first byte reaches the disk.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

BLOCK = 4096
STAGING_BYTES = 16 * 1024 * 1024  # a multiple of BLOCK



def open_for_writing(path: str, mode: int = 0o644) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` created or truncated for writing, with O_DIRECT where the platform and the
    filesystem take it (``direct`` False after a fallback: a filesystem that refuses it answers EINVAL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False

class DirectFile:
    """A write-only file at ``path`` (created or truncated); ``write`` / ``fileno`` / ``close``."""

    def __init__(self, path: str, mode: int = 0o644) -> None:
        self.path = path
        self._mode = mode
        self._fd, self._direct = open_for_writing(path, mode)
        self._buffer = mmap.mmap(-1, STAGING_BYTES)  # page-aligned
        self._view = memoryview(self._buffer)
        self._fill = 0
        self._flushed = 0
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether writes bypass the page cache (False after a fallback)."""
        return self._direct

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            n = min(len(view), STAGING_BYTES - self._fill)
            self._view[self._fill:self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == STAGING_BYTES:
                self._write_out(STAGING_BYTES)
                self._fill = 0
        return total

    def flush(self) -> None:
        """Nothing to do: staged bytes are written by `close` (O_DIRECT writes whole blocks only)."""

    def _write_out(self, length: int) -> None:
        done = 0
        while done < length:
            try:
                n = os.write(self._fd, self._view[done:length])
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._direct and self._flushed == 0 and done == 0:
                    self._fall_back()
                    continue
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n
        self._flushed += length

    def _fall_back(self) -> None:
        """The filesystem took the open flag but refuses direct writes: reopen buffered."""
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self._mode)
        self._direct = False

    def close(self) -> None:
        """Write the tail (padded to a block, then truncated to the true size) and fsync."""
        if self.closed:
            return
        try:
            size = self._flushed + self._fill
            if self._fill:
                padded = -(-self._fill // BLOCK) * BLOCK if self._direct else self._fill
                self._view[self._fill:padded] = bytes(padded - self._fill)
                self._write_out(padded)
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        finally:
            self.closed = True
            os.close(self._fd)
            self._view.release()
            self._buffer.close()


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``size`` bytes rounded up to `BLOCK` (what O_DIRECT writes from)."""
    return mmap.mmap(-1, max(BLOCK, -(-size // BLOCK) * BLOCK))


class PositionedFile:
    """A write-only file at ``path`` of a known final ``size``, written in parts at their offsets, from
    several threads at once (``os.pwrite``), bypassing the page cache where the filesystem allows.

    O_DIRECT's rules are the caller's layout: every `write_at` starts at a multiple of `BLOCK` and is a
    multiple of `BLOCK` long, except the one that ends the file; the data should start page-aligned
    (`aligned_buffer`). The part that ends the file is written as its whole blocks, then its tail
    padded to a block from a small aligned buffer; `close` truncates the padding away and fsyncs.
    Where the filesystem refuses O_DIRECT (at open, or with EINVAL at a write), the file is reopened
    without it (no truncation: parts already written stay) and the write is made again buffered.
    """

    def __init__(self, path: str, size: int, mode: int = 0o644) -> None:
        self.path = path
        self.size = size
        self._lock = threading.Lock()
        self._fd, self._direct = open_for_writing(path, mode)
        self._retired: list[int] = []
        self.closed = False

    @property
    def direct(self) -> bool:
        return self._direct

    def fileno(self) -> int:
        return self._fd

    def write_at(self, offset: int, data) -> None:
        """Write ``data`` at ``offset`` (see the class docstring for the alignment it expects)."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        if end > self.size:
            raise ValueError(f"{self.path}: bytes [{offset}, {end}) end past the planned size {self.size}")
        whole = len(view) - len(view) % BLOCK if self._direct else len(view)
        if whole:
            self._pwrite_all(view[:whole], offset)
        if whole < len(view):  # the file's last bytes: padded to a block from an aligned buffer
            tail = aligned_buffer(BLOCK)
            try:
                tail[:len(view) - whole] = view[whole:]
                self._pwrite_all(memoryview(tail)[:BLOCK] if self._direct else view[whole:], offset + whole)
            finally:
                tail.close()

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            direct, fd = self._direct, self._fd
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and direct:
                    self._fall_back(fd)  # a padded tail written buffered is truncated by `close` too
                    continue
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n

    def _fall_back(self, fd: int) -> None:
        """The filesystem took the open flag but refuses direct writes: reopen buffered (once, for every
        thread: a thread that saw another descriptor fail just retries on the new one). The direct
        descriptor stays open until `close`: another thread may be writing through it."""
        with self._lock:
            if self._fd != fd or not self._direct:
                return
            self._retired.append(fd)
            self._fd = os.open(self.path, os.O_WRONLY)
            self._direct = False

    def close(self) -> None:
        """Truncate to ``size`` (the last block's padding) and fsync. Idempotent."""
        if self.closed:
            return
        try:
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without truncating or syncing (the file is about to be deleted). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for fd in (self._fd, *self._retired):
            os.close(fd)
