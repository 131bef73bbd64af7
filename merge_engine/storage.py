"""Storage over fsspec URLs: plain paths, ``file://``, ``s3://`` (s3fs) and ``gs://`` (gcsfs).

Contract:
- Every function takes URLs (or plain local paths) and returns URLs in the same scheme.
- Listings carry size and a version (ETag / generation / mtime): that is what fingerprints,
  and hence every cache key, are made of. No listing reads a byte of content.
- Reads of weights are ranged (`RangeReader`): a local file is read with ``os.pread`` into
  the caller's buffer, a remote one with bounded ranged GETs (which s3fs and gcsfs retry).
- Writes stream (`open_write`); nothing is held whole in memory.
- S3 endpoints come from ``AWS_ENDPOINT_URL`` (or ``STEPMERGE_S3_ENDPOINT``), credentials from
  the usual AWS variables; GCS emulators from ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import posixpath
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from merge_engine.errors import IncompleteCheckpoint

REMOTE_READ_CHUNK = 32 * 1024 * 1024  # one ranged GET; s3fs retries ranged reads, not whole ones


def split_scheme(url: str) -> tuple[str, str]:
    """``"s3://b/k"`` -> ``("s3", "b/k")``; a plain path or ``file://`` URL -> ``("file", abs path)``."""
    if "://" not in url:
        return "file", os.path.abspath(url)
    scheme, rest = url.split("://", 1)
    if scheme in ("file", "local"):
        return "file", os.path.abspath("/" + rest.lstrip("/")) if rest else "/"
    return scheme, rest


def is_local(url: str) -> bool:
    return split_scheme(url)[0] == "file"


def local_path(url: str) -> str:
    """The filesystem path of a local URL. Raises ValueError for a remote one."""
    scheme, path = split_scheme(url)
    if scheme != "file":
        raise ValueError(f"not a local path: {url}")
    return path


def join(url: str, *parts: str) -> str:
    """Join path components onto a URL with ``/`` (never ``os.sep`` tricks, never ``..``)."""
    for part in parts:
        for piece in part.split("/"):
            if piece in ("..",):
                raise ValueError(f"path traversal in {part!r}")
    if is_local(url) and "://" not in url:
        return os.path.join(url, *parts)
    return posixpath.join(url.rstrip("/"), *parts)


def _s3_options() -> dict[str, Any]:
    endpoint = os.environ.get("STEPMERGE_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    options: dict[str, Any] = {}
    if endpoint:
        options["endpoint_url"] = endpoint
    return options


def _gcs_options() -> dict[str, Any]:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        return {"token": "anon"}
    return {}


def filesystem(url: str):
    """The fsspec filesystem for a URL and the path inside it."""
    import fsspec

    scheme, path = split_scheme(url)
    if scheme == "file":
        return fsspec.filesystem("file"), path
    if scheme in ("s3", "s3a"):
        return fsspec.filesystem("s3", **_s3_options()), path
    if scheme in ("gs", "gcs"):
        return fsspec.filesystem("gcs", **_gcs_options()), path
    return fsspec.filesystem(scheme), path


@dataclass(frozen=True)
class FileEntry:
    """One file under a listed root: path relative to the root (``/``-separated), size, version."""

    path: str
    size: int
    version: str


def _version_of(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "updated"):
        value = info.get(key)
        if value not in (None, ""):
            return str(value).strip('"')
    return ""


def list_files(url: str, recursive: bool = True) -> list[FileEntry]:
    """Every file under ``url`` with its size and version, sorted by path. Missing root -> []."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    try:
        if recursive:
            found = fs.find(root, detail=True)
        else:
            found = {i["name"]: i for i in fs.ls(root, detail=True) if i.get("type") == "file"}
    except FileNotFoundError:
        return []
    entries = []
    prefix = root + "/"
    for name, info in found.items():
        if info.get("type") not in ("file", None):
            continue
        name = name.rstrip("/")
        if not name.startswith(prefix):
            continue
        entries.append(FileEntry(name[len(prefix):], int(info.get("size") or 0), _version_of(info)))
    return sorted(entries, key=lambda e: e.path)


def list_dirs(url: str) -> list[str]:
    """Names of the immediate sub-folders of ``url`` (no files). Missing root -> []."""
    fs, root = filesystem(url)
    try:
        infos = fs.ls(root.rstrip("/"), detail=True)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(i["name"].rstrip("/")) for i in infos if i.get("type") == "directory")


def fingerprint(entries: Iterable[FileEntry], **options: Any) -> str:
    """A stable sha256 of a listing (names, sizes, versions) plus options: the cache key's core."""
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.size}\0{entry.version}\n".encode())
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def info(url: str) -> dict[str, Any]:
    fs, path = filesystem(url)
    return fs.info(path)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path)


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def write_bytes(url: str, data: bytes) -> None:
    """Write a small file whole (local: to a temp name, then rename)."""
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


def open_write(url: str) -> IO[bytes]:
    """A streaming binary writer; parent folders are created for local paths."""
    fs, path = filesystem(url)
    if is_local(url):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return open(path, "wb")
    return fs.open(path, "wb")


def remove(url: str, recursive: bool = False) -> None:
    """Delete a file or (``recursive``) a folder; a missing one is not an error."""
    fs, path = filesystem(url)
    if is_local(url):
        if os.path.isdir(path):
            if recursive:
                shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
        return
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


def copy_file(src: str, dst: str) -> None:
    """Copy one file between any two URLs, streaming."""
    if is_local(src) and is_local(dst):
        os.makedirs(os.path.dirname(local_path(dst)) or ".", exist_ok=True)
        shutil.copyfile(local_path(src), local_path(dst))
        return
    src_fs, src_path = filesystem(src)
    if is_local(src) and not is_local(dst):
        dst_fs, dst_path = filesystem(dst)
        dst_fs.put_file(src_path, dst_path)
        return
    if not is_local(src) and is_local(dst):
        os.makedirs(os.path.dirname(local_path(dst)) or ".", exist_ok=True)
        src_fs.get_file(src_path, local_path(dst))
        return
    with src_fs.open(src_path, "rb") as fin, open_write(dst) as fout:
        shutil.copyfileobj(fin, fout, REMOTE_READ_CHUNK)


class RangeReader:
    """Random-access reads of one file: ``read_into(offset, buffer)`` fills the buffer exactly.

    Local files use ``os.pread`` (no mmap, so resident memory stays with the caller's buffer);
    remote files use ranged GETs of at most `REMOTE_READ_CHUNK` bytes. A short read means the
    file is shorter than its metadata promised: it raises `IncompleteCheckpoint`.
    """

    def __init__(self, url: str, size: int | None = None) -> None:
        self.url = url
        self._fd: int | None = None
        if is_local(url):
            self._fd = os.open(local_path(url), os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size
        else:
            self._fs, self._path = filesystem(url)
            self.size = int(size if size is not None else self._fs.size(self._path))

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer = memoryview(buffer).cast("B")
        want = len(buffer)
        if offset < 0 or offset + want > self.size:
            raise IncompleteCheckpoint(
                f"read of {want} bytes at {offset} runs past the end ({self.size} bytes): truncated file",
                self.url,
            )
        done = 0
        while done < want:
            if self._fd is not None:
                n = os.preadv(self._fd, [buffer[done:]], offset + done)
            else:
                end = min(want, done + REMOTE_READ_CHUNK)
                data = self._fs.cat_file(self._path, start=offset + done, end=offset + end)
                n = len(data)
                buffer[done:done + n] = data
            if n <= 0:
                raise IncompleteCheckpoint(f"unexpected end of file at byte {offset + done}", self.url)
            done += n

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stage_in(url: str, files: Iterable[FileEntry], cache_dir: str, max_workers: int = 8) -> dict[str, str]:
    """Copy ``files`` (relative to ``url``) into ``cache_dir`` in parallel; return rel -> local path.

    A file already in the cache with the listed size is not fetched again; each fetched file is
    verified by size. Local sources are not copied: their own paths are returned.
    """
    files = list(files)
    if is_local(url):
        return {f.path: os.path.join(local_path(url), f.path) for f in files}

    def fetch(entry: FileEntry) -> tuple[str, str]:
        dest = os.path.join(cache_dir, *entry.path.split("/"))
        if os.path.exists(dest) and os.path.getsize(dest) == entry.size:
            return entry.path, dest
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.part-{os.getpid()}"
        copy_file(join(url, entry.path), tmp)
        got = os.path.getsize(tmp)
        if got != entry.size:
            os.remove(tmp)
            raise IncompleteCheckpoint(f"staged {got} bytes, listing said {entry.size}", join(url, entry.path))
        os.replace(tmp, dest)
        return entry.path, dest

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        return dict(pool.map(fetch, files))
