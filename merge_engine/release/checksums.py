"""Checksums of published files: is each file still the bytes its manifest recorded?

`file_damage(url, files, listing, mode)` compares manifest entries (anything with ``path``,
``size``, ``sha256`` and ``version``) with one listing of ``url`` and returns one line per bad
file. Two costs (``mode``):
- ``"full"``: every byte is re-hashed (`merge_engine.storage.sha256.sha256_of`: ranged reads, bounded
  memory): the cost of reading the files once.
- ``"quick"``: on object stores, the version the store gave each file when it was published (S3
  ETag: an MD5 the server computed from the bytes it received; GCS generation), recorded in the
  manifest, is compared with the listing: no byte read. Any rewrite of an object changes it.
  Files without a recorded version (local files, whose mtime/inode is no checksum; manifests
  written before versions were recorded) are re-hashed as in ``"full"``. A quick verdict is
  remembered in this process for `MEMO_S` seconds, keyed by the URL, the manifest and every
  listed file's size, version and (local) inode change time, so the pipeline's several "already
  published?" questions about one release in one run cost one verification, and any write since
  (even one that sets the mtime back) is seen. Damage that bypasses the filesystem (bit rot) is
  seen once the memo expires.
Files in the listing that the manifest does not list are damage too, except ``ignored`` names. A
local entry that is not a regular file (a FIFO, a device, a link: a forged manifest may list one with
size 0) is damage and is never opened.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

from merge_engine import storage
from merge_engine.storage.sha256 import sha256_of

MEMO_S = float(os.environ.get("STEPMERGE_VERIFY_MEMO_S", "300"))
MODES = ("full", "quick")


class RecordedFile(Protocol):
    """A file as a record lists it (read-only: frozen records qualify)."""

    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def sha256(self) -> str: ...
    @property
    def version(self) -> str: ...


def _change_time(url: str, path: str, remote: bool) -> int:
    """A local file's inode change time: any write or ``utime`` through the filesystem moves it (a
    writer can set mtime back, never ctime), so a remembered verdict never outlives a rewrite."""
    if remote:
        return 0
    try:
        return os.stat(storage.local_path(storage.join(url, path))).st_ctime_ns
    except OSError:
        return -1


def _regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file itself (``lstat``: a link is not): only those are ever opened."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_MEMO: dict[tuple, tuple[float, tuple[str, ...], int]] = {}
_MEMO_LOCK = threading.Lock()


def file_damage(url: str, files: Iterable[RecordedFile], listing: Mapping[str, storage.FileEntry],
                mode: str = "quick", ignored: Iterable[str] | None = ()) -> tuple[tuple[str, ...], int, str]:
    """(problems, bytes hashed, method) of recorded ``files`` against a listing of ``url``. A listed
    file that is not recorded is a problem unless its first path component is in ``ignored``
    (``None``: unrecorded files are not looked at)."""
    files = tuple(files)
    ignored = None if ignored is None else frozenset(ignored)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    remote = not storage.is_local(url)
    key = (url, mode, tuple((f.path, f.size, f.sha256, f.version) for f in files), ignored,
           tuple(sorted((e.path, e.size, e.version, _change_time(url, e.path, remote)) for e in listing.values())))
    now = time.monotonic()
    with _MEMO_LOCK:
        hit = _MEMO.get(key) if mode == "quick" else None
    if hit is not None and now - hit[0] < MEMO_S:
        return hit[1], 0, "remembered"
    problems: list[str] = []
    hashed = 0
    methods: set[str] = set()
    for f in files:
        entry = listing.get(f.path)
        if entry is None:
            problems.append(f"{f.path}: missing")
            continue
        if entry.size != f.size:
            problems.append(f"{f.path}: {entry.size} bytes, manifest says {f.size}")
            continue
        if mode == "quick" and remote and f.version:
            methods.add("store versions")
            if entry.version != f.version:
                problems.append(f"{f.path}: rewritten since published (store version {entry.version}, "
                                f"manifest says {f.version})")
            continue
        methods.add("sha256")
        if not remote and not _regular_file(storage.local_path(storage.join(url, f.path))):
            problems.append(f"{f.path}: not a regular file (never opened: a FIFO or device would hang a read)")
            continue
        if sha256_of(storage.join(url, f.path), f.size) != f.sha256:
            problems.append(f"{f.path}: sha256 differs from the manifest")
        hashed += f.size
    known = {f.path for f in files}
    skipped = ignored if ignored is not None else frozenset()
    for path in sorted(listing) if ignored is not None else ():
        if path not in known and path not in skipped and path.split("/")[0] not in skipped:
            problems.append(f"{path}: not in the manifest")
    method = " + ".join(sorted(methods, reverse=True)) or "sizes"
    with _MEMO_LOCK:
        _MEMO[key] = (now, tuple(problems), hashed)
    return tuple(problems), hashed, method



__all__ = ["MEMO_S", "MODES", "RecordedFile", "file_damage"]
