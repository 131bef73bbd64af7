"""Copies between any two URLs (`copy_file`, `copy_tree`) and staging remote files to a local cache
(`stage_in`). Every copy streams and its destination appears whole or not at all."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Iterable
from typing import Any

from merge_engine.errors import IncompleteCheckpoint, StepmergeError
from merge_engine.storage.json_text import read_local_json
from merge_engine.storage import tuning
from merge_engine.storage.atomic_writer import open_write
from merge_engine.storage.backends.local import temp_name, unlink_quietly
from merge_engine.storage.entries import FileEntry
from merge_engine.storage.files import list_files, write_bytes
from merge_engine.storage.range_reader import RangeReader
from merge_engine.storage.schemes import backend_for
from merge_engine.storage.urls import is_local, join, local_path

STAGE_MANIFEST = ".stepmerge-staged.json"  # in a stage_in cache dir: rel path -> size and version staged


def _download(src: str, dst_path: str, expected_size: int | None = None) -> int:
    """Copy a remote file to a local path (temp name + rename) with retried ranged GETs.

    Returns the size. The remote size must equal ``expected_size`` when given, else
    `IncompleteCheckpoint` (the file changed since it was listed).
    """
    reader = RangeReader(src)
    if expected_size is not None and reader.size != expected_size:
        raise IncompleteCheckpoint(f"file is {reader.size} bytes, listing said {expected_size}", src)
    os.makedirs(os.path.dirname(dst_path) or ".", exist_ok=True)
    tmp = temp_name(dst_path)
    chunk = tuning.REMOTE_READ_CHUNK
    try:
        with open(tmp, "wb") as out:
            buffer = bytearray(min(chunk, reader.size))
            view = memoryview(buffer)
            for offset in range(0, reader.size, chunk):
                n = min(chunk, reader.size - offset)
                reader.read_into(offset, view[:n])
                out.write(view[:n])
            out.flush()
            os.fsync(out.fileno())
            got = out.tell()
        if got != reader.size:
            raise IncompleteCheckpoint(f"staged {got} bytes, expected {reader.size}", src)
        os.replace(tmp, dst_path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return reader.size


def copy_file(src: str, dst: str) -> None:
    """Copy one file between any two URLs, streaming; the destination appears whole or not at all.

    Same remote store: a server-side copy. Remote to local: retried ranged GETs. Local to remote:
    the library's (multipart / resumable) upload, retried whole on transient faults. Remote to
    another remote: ranged reads streamed into `open_write`. A missing source: FileNotFoundError.
    """
    src_backend, dst_backend = backend_for(src), backend_for(dst)
    if src_backend.local and dst_backend.local:
        dst_backend.copy_within(src, dst)
        return
    if src_backend.local:
        source = local_path(src)
        if not os.path.isfile(source):
            raise FileNotFoundError(source)
        dst_backend.upload_file(source, dst)
        return
    if not src_backend.isfile(src):
        raise FileNotFoundError(src)
    if dst_backend.local:
        _download(src, local_path(dst))
        return
    if dst_backend is src_backend and src_backend.copy_within(src, dst):
        return
    reader = RangeReader(src)
    chunk = tuning.REMOTE_READ_CHUNK
    with open_write(dst) as out:
        buffer = memoryview(bytearray(min(chunk, max(reader.size, 1))))
        for offset in range(0, reader.size, chunk):
            n = min(chunk, reader.size - offset)
            reader.read_into(offset, buffer[:n])
            out.write(buffer[:n])


def _load_stage_manifest(cache_dir: str) -> dict[str, dict[str, Any]]:
    try:
        loaded = read_local_json(os.path.join(cache_dir, STAGE_MANIFEST))
    except (OSError, StepmergeError):  # absent, or debris (the guarded parser: bounded, never a traceback)
        return {}
    return loaded if isinstance(loaded, dict) else {}


def stage_in(url: str, files: Iterable[FileEntry], cache_dir: str, max_workers: int = 8) -> dict[str, str]:
    """Copy ``files`` (relative to ``url``) into ``cache_dir`` in parallel; return rel -> local path.

    A file already staged with the same size *and version* (recorded in ``cache_dir``'s
    `STAGE_MANIFEST`) is not fetched again: a rewritten checkpoint with identical sizes is.
    Each file is fetched with retried ranged GETs to a temp name and renamed when whole; a file
    whose size differs from its listing raises `IncompleteCheckpoint`. Local sources are not
    copied: their own paths are returned, after the same size check.
    """
    files = list(files)
    for entry in files:
        join(url, entry.path)  # refuses traversal before anything is written
    if is_local(url):
        root = local_path(url)
        out = {}
        for entry in files:
            path = os.path.join(root, *entry.path.split("/"))
            try:
                got = os.path.getsize(path)
            except FileNotFoundError as exc:
                raise IncompleteCheckpoint("file is missing", path) from exc
            if got != entry.size:
                raise IncompleteCheckpoint(f"file is {got} bytes, listing said {entry.size}", path)
            out[entry.path] = path
        return out

    os.makedirs(cache_dir, exist_ok=True)
    staged = _load_stage_manifest(cache_dir)
    lock = threading.Lock()

    def fetch(entry: FileEntry) -> tuple[str, str]:
        dest = os.path.join(cache_dir, *entry.path.split("/"))
        record = staged.get(entry.path)
        if (
            record == {"size": entry.size, "version": entry.version}
            and os.path.isfile(dest)
            and os.path.getsize(dest) == entry.size
        ):
            return entry.path, dest
        _download(join(url, entry.path), dest, expected_size=entry.size)
        with lock:
            staged[entry.path] = {"size": entry.size, "version": entry.version}
        return entry.path, dest

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
            return dict(pool.map(fetch, files))
    finally:
        with lock:
            write_bytes(os.path.join(cache_dir, STAGE_MANIFEST), json.dumps(staged, sort_keys=True).encode())


def copy_tree(src: str, dst: str, max_workers: int = 8) -> list[FileEntry]:
    """Copy every file under ``src`` to the same relative path under ``dst`` (any two URLs)."""
    entries = list_files(src)

    def copy(entry: FileEntry) -> None:
        copy_file(join(src, entry.path), join(dst, entry.path))

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(copy, entries))
    return entries
