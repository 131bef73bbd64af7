"""Listings, metadata, small reads and writes, and removal at any URL: each asks the URL's backend."""

from __future__ import annotations

from typing import Any

from merge_engine.storage.entries import FileEntry
from merge_engine.storage.schemes import backend_for


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for a URL and the path inside it.

    Remote filesystems keep no listings cache and are shared per process and per configuration
    (the relevant environment variables), never across a change of server.
    """
    return backend_for(url).filesystem(url)


def list_files(url: str, recursive: bool = True) -> list[FileEntry]:
    """Every file under ``url`` with its size and version, sorted by path. Missing root -> [].

    Always a fresh listing. Empty "folders" (S3 prefixes whose objects were deleted) add nothing.
    """
    return sorted(backend_for(url).list_files(url, recursive), key=lambda e: e.path)


def list_dirs(url: str) -> list[str]:
    """Names of the immediate sub-folders of ``url`` (no files), sorted. Missing root -> [].

    On object stores a folder is a prefix, and SeaweedFS (like some S3 gateways) keeps an emptied
    prefix listed for a while: a name here does not prove the folder holds anything.
    """
    return sorted(backend_for(url).list_dirs(url))


def exists(url: str) -> bool:
    return backend_for(url).exists(url)


def info(url: str) -> dict[str, Any]:
    """The storage library's metadata for one file or folder. Missing -> FileNotFoundError."""
    return backend_for(url).info(url)


def size(url: str) -> int:
    """The size of one file in bytes. Missing -> FileNotFoundError."""
    return backend_for(url).size(url)


def read_bytes(url: str) -> bytes:
    """A whole (small) file. Large remote files: read them with `RangeReader`."""
    return backend_for(url).read_bytes(url)


def write_bytes(url: str, data: bytes) -> None:
    """Write a small file whole (local: to a temp name, fsync, then rename)."""
    backend_for(url).write_bytes(url, data)


def remove(url: str, recursive: bool = False) -> None:
    """Delete a file or (``recursive``) a folder; a missing one is not an error.

    A folder without ``recursive`` is left alone. On S3 an emptied prefix may still be listed by
    `list_dirs` for a while (SeaweedFS); its files are gone at once.
    """
    backend_for(url).remove(url, recursive)


def abort_uploads(url: str, not_before: str) -> list[str]:
    """Abort the unfinished uploads (S3 multipart uploads) of files under the folder ``url`` begun no
    earlier than the file ``not_before`` was written (same store, the server's clock); their paths
    relative to ``url``. Uploads outside ``url`` are never touched; stores without listable
    unfinished uploads abort nothing (`Backend.abort_uploads`)."""
    return backend_for(url).abort_uploads(url, not_before)
