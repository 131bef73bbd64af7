"""The contract every storage backend meets (`Backend`), and `FsspecBackend`, the shared body of
every backend whose client is an fsspec filesystem (S3, GCS, in-memory; Azure would be one more).

A backend serves the URLs of its `Backend.schemes` and is found through the registry
(`merge_engine.storage.schemes`). Its methods take whole URLs and keep the storage layer's promises
(see `merge_engine.storage`): fresh listings with a version per file, ranged reads that fill the
caller's buffer or raise `IncompleteCheckpoint`, uploads that appear whole or not at all, and
retries (`faults.retrying`) of transient faults wherever a call can be repeated safely.
"""

from __future__ import annotations

import asyncio
import gc
import os
import posixpath
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol

from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import tuning
from merge_engine.storage.body import Body, copy_range, is_body
from merge_engine.storage.entries import FileEntry
from merge_engine.storage.faults import logger, retrying
from merge_engine.storage.read_ahead import ReadAhead
from merge_engine.storage.urls import split_scheme


class RangedFile(Protocol):
    """One open file for random-access reads (what `RangeReader` reads through)."""

    size: int

    def read_some(self, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` into ``out``; the count (0 at an unexpected end)."""

    def close(self) -> None: ...


class Upload(Protocol):
    """One file being written (what `AtomicWriter` writes through): nothing is visible before `commit`."""

    def write(self, data: Any) -> None: ...

    def flush(self) -> None: ...

    def commit(self) -> None:
        """Make the whole file visible under its name (raises if that fails; then `discard` cleans up)."""

    def discard(self) -> None:
        """Throw away what was written; the target is left as it was."""


class PartsUpload(Protocol):
    """One file of a known size written in numbered parts, from several threads at once, in any order
    (what a shard cut into byte ranges writes through; `Backend.open_parts`). Nothing is visible
    before `commit`.

    ``part_bytes``: the size of every part but the last (the store's rules may have raised the size
    asked for); part ``index`` holds the file's bytes ``[index * part_bytes, ...)``. ``buffer(n)``: a
    buffer of ``n`` bytes that `write_part` accepts without a copy (local: page-aligned, for O_DIRECT).
    """

    part_bytes: int

    def buffer(self, size: int) -> Any: ...

    def write_part(self, index: int, data: memoryview) -> None:
        """Store part ``index`` (thread-safe; each index written once)."""

    def commit(self) -> None:
        """Make the whole file visible under its name, once every part is written."""

    def discard(self) -> None:
        """Throw away every part written; the target is left as it was."""


class Backend:
    """One storage system behind the storage layer's interface.

    Class attributes: ``schemes``, the URL spellings it serves (the first is canonical); ``local``,
    whether its paths are on this machine's filesystem; ``shared``, whether another process or
    machine reaching the same URL sees the same files (False for an in-process store: such URLs
    are refused where a URL crosses a process, e.g. flow parameters and webhooks).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    local: ClassVar[bool] = False
    shared: ClassVar[bool] = True

    @property
    def canonical_scheme(self) -> str:
        return self.schemes[0]

    def filesystem(self, url: str) -> tuple[Any, str]:
        """The fsspec filesystem for ``url`` and the path inside it."""
        raise NotImplementedError

    def classify_fault(self, exc: BaseException) -> bool | None:
        """True / False: this backend's client says the fault is transient / permanent; None: not its error."""
        return None

    def portable_options(self) -> dict[str, Any]:
        """JSON-safe fsspec options that point another client (another process) at the same store."""
        return {}

    # listings and metadata
    def list_files(self, url: str, recursive: bool) -> list[FileEntry]:
        raise NotImplementedError

    def list_dirs(self, url: str) -> list[str]:
        raise NotImplementedError

    def exists(self, url: str) -> bool:
        raise NotImplementedError

    def isfile(self, url: str) -> bool:
        raise NotImplementedError

    def info(self, url: str) -> dict[str, Any]:
        fs, path = self.filesystem(url)
        return retrying(lambda: fs.info(path), f"info {url}", self.classify_fault)

    def size(self, url: str) -> int:
        return int(self.info(url)["size"])

    # reads and writes
    def read_bytes(self, url: str) -> bytes:
        raise NotImplementedError

    def write_bytes(self, url: str, data: bytes) -> None:
        raise NotImplementedError

    def open_upload(self, url: str, block_size: int | None, size_hint: int | None) -> Upload:
        raise NotImplementedError

    def open_range(self, url: str, size: int | None, version: str | None = None) -> RangedFile:
        """Open for ranged reads; a missing file raises `IncompleteCheckpoint`. With ``version`` (a
        listing's), every read is of that version or raises `SourceChanged` (see `RangeReader`)."""
        raise NotImplementedError

    def open_parts(self, url: str, size: int, part_bytes: int) -> PartsUpload | None:
        """Write ``url`` (``size`` bytes) as numbered parts of about ``part_bytes`` in any order, from
        several threads (`PartsUpload`); None where the store can only take a file's bytes in order
        (then a caller writes them in order through `open_upload`)."""
        return None

    def remove(self, url: str, recursive: bool) -> None:
        raise NotImplementedError

    def abort_uploads(self, url: str, not_before: str) -> list[str]:
        """Abort the unfinished uploads of files under the folder ``url`` begun no earlier than the file
        ``not_before`` (of the same store) was written; their paths relative to ``url``. Stores whose
        unfinished uploads leave nothing to list abort nothing: local writes go to temp files (swept
        with their temp folders), GCS resumable sessions cannot be listed and expire."""
        return []

    # copies (the storage layer's `copy_file` picks among these)
    def upload_file(self, local_path: str, url: str) -> None:
        """Copy a local file to ``url`` (this backend's) whole."""
        raise NotImplementedError

    def copy_within(self, src: str, dst: str) -> bool:
        """Copy ``src`` to ``dst`` (both this backend's) inside the store; False when it cannot."""
        return False


# --------------------------------------------------------------------------------------------
# Backends whose client is an fsspec filesystem

_FS_CACHE: dict[tuple[Any, ...], Any] = {}
_FS_LOCK = threading.Lock()
TIMEOUT_ENV = "STEPMERGE_STORAGE_TIMEOUT"  # seconds: bounds connecting and each socket read, every remote store


def storage_timeout() -> float | None:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else None


def clear_filesystems() -> None:
    """Drop every cached remote client, closing its connections now (while fsspec's event loop runs).

    For processes that switch servers many times (test sessions): left to interpreter exit, each
    stale client's shutdown waits on its own timeout.
    """
    with _FS_LOCK:
        stale = list(_FS_CACHE.values())
        _FS_CACHE.clear()
    del stale
    gc.collect()


class FsspecBackend(Backend):
    """A store reached through one fsspec filesystem class.

    A subclass names its ``schemes``, the environment variables its client depends on
    (``env_keys``: a change in any of them gives a new client, so a process that switches servers
    never talks to the old one), how to build the client (`make_client`), which ``info`` fields
    carry a file's version (``version_keys``, first present wins), and its client's faults
    (`classify_fault`). Clients keep no listings cache and are shared per process and configuration.
    """

    env_keys: ClassVar[tuple[str, ...]] = ()
    version_keys: ClassVar[tuple[str, ...]] = ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified",
                                               "updated")

    def make_client(self, **common: Any) -> Any:
        """A new filesystem object; ``common`` disables fsspec's instance and listings caches."""
        import fsspec

        return fsspec.filesystem(self.canonical_scheme, **common)

    def check_credentials(self, url: str) -> None:
        """Raise `CredentialsMissing` (naming what to set) when the client would find no credentials,
        before it is built: a client without them fails each request only after its retries."""

    def path_in(self, fs: Any, url: str, rest: str) -> str:
        """The path inside ``fs`` that ``url`` (``<scheme>://<rest>``) names."""
        return fs._strip_protocol(url)  # e.g. memory://x -> /x, as the filesystem stores it

    def filesystem(self, url: str) -> tuple[Any, str]:
        _, rest = split_scheme(url)
        key = (self.canonical_scheme, os.getpid(), tuple(os.environ.get(k) for k in (*self.env_keys, TIMEOUT_ENV)))
        with _FS_LOCK:
            fs = _FS_CACHE.get(key)
            if fs is None:
                self.check_credentials(url)
                fs = _FS_CACHE[key] = self.make_client(skip_instance_cache=True, use_listings_cache=False)
        return fs, self.path_in(fs, url, rest)

    def version_of(self, info: Mapping[str, Any]) -> str:
        for key in self.version_keys:
            value = info.get(key)
            if value not in (None, ""):
                return str(value).strip('"')
        return ""

    def list_files(self, url: str, recursive: bool) -> list[FileEntry]:
        fs, root = self.filesystem(url)
        root = root.rstrip("/") or "/"

        def listing() -> dict[str, Any]:
            try:
                if recursive:
                    return fs.find(root, detail=True)
                return {i["name"]: i for i in fs.ls(root, detail=True)}
            except FileNotFoundError:
                return {}

        found = retrying(listing, f"listing {url}", self.classify_fault)
        entries = []
        prefix = root + "/"
        for name, info in found.items():
            if info.get("type") not in ("file", None):
                continue
            name = name.rstrip("/")
            if not name.startswith(prefix):
                continue
            entries.append(FileEntry(name[len(prefix):], int(info.get("size") or 0), self.version_of(info)))
        return entries

    def list_dirs(self, url: str) -> list[str]:
        fs, _ = self.filesystem(url)
        _, root = split_scheme(url)

        def listing() -> list[dict[str, Any]]:
            try:
                return fs.ls(root.rstrip("/"), detail=True)
            except FileNotFoundError:
                return []

        infos = retrying(listing, f"listing {url}", self.classify_fault)
        return [posixpath.basename(i["name"].rstrip("/")) for i in infos if i.get("type") == "directory"]

    def exists(self, url: str) -> bool:
        fs, path = self.filesystem(url)
        return retrying(lambda: fs.exists(path), f"exists {url}", self.classify_fault)

    def isfile(self, url: str) -> bool:
        fs, path = self.filesystem(url)
        return retrying(lambda: fs.isfile(path), f"info {url}", self.classify_fault)

    def read_bytes(self, url: str) -> bytes:
        fs, path = self.filesystem(url)
        return retrying(lambda: fs.cat_file(path), f"reading {url}", self.classify_fault)

    def write_bytes(self, url: str, data: bytes) -> None:
        fs, path = self.filesystem(url)
        retrying(lambda: fs.pipe_file(path, data), f"writing {url}", self.classify_fault)

    def open_upload(self, url: str, block_size: int | None, size_hint: int | None) -> Upload:
        return FsspecUpload(self, url, block_size)

    def open_range(self, url: str, size: int | None, version: str | None = None) -> RangedFile:
        return FsspecRangedFile(self, url, size, version)

    async def read_range(self, fs: Any, path: str, start: int, end: int, version: str | None,
                         url: str) -> bytes | Body:
        """Bytes ``[start, end)`` of ``path`` (one ranged GET, on the filesystem's event loop), as `bytes` or a
        `body.Body` (the pieces received, never joined: the reader copies them once). A backend
        that can pin a read to the ``version`` listed overrides this and raises `SourceChanged` when the
        store holds another version; this default cannot (an in-process store: nobody else writes it)."""
        return await fs._cat_file(path, start=start, end=end)

    def remove(self, url: str, recursive: bool) -> None:
        fs, path = self.filesystem(url)

        def delete() -> None:
            try:
                fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        retrying(delete, f"removing {url}", self.classify_fault)

    def upload_file(self, local_path: str, url: str) -> None:
        fs, path = self.filesystem(url)
        options = self.upload_options(os.path.getsize(local_path))
        retrying(lambda: fs.put_file(local_path, path, **options), f"uploading {local_path} to {url}",
                 self.classify_fault)

    def upload_options(self, size: int) -> dict[str, Any]:
        """Keyword arguments of the client's ``put_file`` that bound the memory one upload holds."""
        return {}

    def copy_within(self, src: str, dst: str) -> bool:
        src_fs, src_path = self.filesystem(src)
        dst_fs, dst_path = self.filesystem(dst)
        if dst_fs is not src_fs:
            return False
        retrying(lambda: src_fs.cp_file(src_path, dst_path), f"copying {src} to {dst}", self.classify_fault)
        return True


class FsspecUpload:
    """An fsspec write (an S3 multipart upload, a GCS resumable upload) committed by the server on close."""

    def __init__(self, backend: FsspecBackend, url: str, block_size: int | None) -> None:
        self.url = url
        fs, path = backend.filesystem(url)
        kwargs = {"block_size": block_size} if block_size else {}
        self._file = fs.open(path, "wb", **kwargs)

    def write(self, data: Any) -> None:
        self._file.write(data)

    def flush(self) -> None:
        pass  # a remote part is sent when it is full, never early

    def commit(self) -> None:
        self._file.close()

    def discard(self) -> None:
        try:
            discard = getattr(self._file, "discard", None)
            if discard is not None:
                discard()  # s3fs aborts the multipart upload, gcsfs cancels the resumable one
        except Exception as exc:  # the upload is abandoned either way: its parts expire
            logger.warning("could not cancel the upload to %s: %s", self.url, exc)
        finally:
            self._file.closed = True  # never let fsspec's own close/__del__ commit it


class FsspecRangedFile:
    """Ranged GETs, many in flight. On an async client (S3, GCS), reads that move forward are served by
    `read_ahead.ReadAhead`: the bytes ahead are fetched in parts, concurrently, on the filesystem's
    event loop. Any other read is cut into up to `tuning.REQUESTS_IN_FLIGHT` parts of at least
    `tuning.MIN_RANGE_PART` bytes (and at most `tuning.REMOTE_READ_CHUNK`), fetched concurrently.
    A part that fails is fetched again alone, retried on transient faults. One request at a time
    pays the round trip for every part; object storage gives its throughput only to many requests
    in flight. Every GET goes through the backend's `FsspecBackend.read_range`, pinned to
    ``version`` where the backend can (S3 ``If-Match``, GCS ``generation``): `SourceChanged`.

    ``size`` (from a listing) saves the HEAD request."""

    def __init__(self, backend: FsspecBackend, url: str, size: int | None, version: str | None = None) -> None:
        self.url = url
        self._backend = backend
        self._version = version
        self._fs, self._path = backend.filesystem(url)
        self._async = bool(getattr(self._fs, "async_impl", False))
        self.classify_fault = backend.classify_fault  # this store's transient faults, for its retries
        if size is None:
            try:
                size = int(retrying(lambda: self._fs.size(self._path), f"size of {url}", self.classify_fault))
            except FileNotFoundError as exc:
                raise IncompleteCheckpoint("file is missing", url) from exc
        self.size = int(size)
        self._ahead = ReadAhead(self.size, self._fetch, self._get) \
            if self._async and tuning.READ_AHEAD_BUDGET > 0 else None

    def _request(self, start: int, end: int) -> Future:
        """One ranged GET started on the filesystem's event loop (async clients only)."""
        coroutine = self._backend.read_range(self._fs, self._path, start, end, self._version, self.url)
        return asyncio.run_coroutine_threadsafe(coroutine, self._fs.loop)

    def _fetch(self, start: int, end: int) -> Future:
        """A part fetched ahead (`ReadAhead`'s ``fetch``)."""
        return self._request(start, end)

    def read_some(self, offset: int, out: memoryview) -> int:
        if self._ahead is not None:
            served = self._ahead.read(offset, out)
            if served:
                return served
        want = min(len(out), tuning.REMOTE_READ_CHUNK * max(1, tuning.REQUESTS_IN_FLIGHT))
        parts = range_parts(offset, want)
        pending: list[Future | None] = [None] * len(parts)
        if len(parts) > 1 and self._async:
            pending = [self._request(start, end) for start, end in parts]
        try:
            for index, (start, end) in enumerate(parts):
                data = _result_or_none(pending[index])
                if data is None or len(data) != end - start:  # failed or short: fetched again alone, retried
                    data = self._get(start, end)
                copy_range(data, 0, end - start, out[start - offset:end - offset])
        finally:
            for future in pending:
                if future is not None:
                    future.cancel()
        return want

    def _get(self, start: int, end: int) -> bytes | Body:
        def get() -> bytes:
            try:
                if self._async:
                    return self._request(start, end).result()
                return self._fs.cat_file(self._path, start=start, end=end)
            except FileNotFoundError as exc:
                raise IncompleteCheckpoint("file disappeared while being read", self.url) from exc
            except Exception as exc:
                if _is_range_error(exc):
                    raise IncompleteCheckpoint(
                        f"bytes {start}-{end} are past the end of the file: truncated file", self.url
                    ) from exc
                raise

        data = retrying(get, f"bytes {start}-{end} of {self.url}", self.classify_fault)
        if len(data) != end - start:
            raise IncompleteCheckpoint(
                f"got {len(data)} of bytes {start}-{end} (file shorter than the {self.size} bytes listed)",
                self.url,
            )
        return data

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()


def _result_or_none(future: Future | None) -> bytes | Body | None:
    """A part's bytes, or None when it was not fetched or its fetch failed (the caller fetches it again,
    with retries, and raises the storage layer's named errors)."""
    if future is None:
        return None
    try:
        data = future.result()
    except Exception:  # noqa: BLE001 - fetched again by the caller
        return None
    return data if is_body(data) else None


def range_parts(offset: int, length: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` cut into at most `tuning.REQUESTS_IN_FLIGHT` (start, end) parts of at
    least `tuning.MIN_RANGE_PART` and at most `tuning.REMOTE_READ_CHUNK` bytes (the last may be shorter)."""
    if length <= 0:
        return [(offset, offset)]
    count = max(1, min(tuning.REQUESTS_IN_FLIGHT, -(-length // max(1, tuning.MIN_RANGE_PART))))
    count = max(count, -(-length // tuning.REMOTE_READ_CHUNK))
    step = -(-length // count)
    return [(start, min(start + step, offset + length)) for start in range(offset, offset + length, step)]


def _is_range_error(exc: BaseException) -> bool:
    link: BaseException | None = exc
    for _ in range(8):
        if link is None:
            return False
        response = getattr(link, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "InvalidRange":
            return True
        if getattr(link, "code", None) == 416 or getattr(link, "status", None) == 416:
            return True
        if "InvalidRange" in str(link) or "Requested Range Not Satisfiable" in str(link):
            return True
        link = link.__cause__ or link.__context__
    return False
