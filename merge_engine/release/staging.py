"""Staging: the merge writes to a local staging folder (``$STEPMERGE_STAGING_DIR``, else the system temp dir),
validation reads it there, publishing uploads it once. `staging_url` derives a name from the release and the
fingerprint, so a retry after a crash finds (and the engine reuses) a finished merge. Publishing removes its
staging folder (also when it refuses); a folder of ours that nobody has written to for `STALE_STAGING_S` is
removed by the next merge into the same staging root (`sweep_stale_staging`).

Beside a staging folder, in a sibling folder ``<staging>.stepmerge-sums``, the build keeps the sha256 its shard
jobs computed of every weight file and index while writing them (`keep_checksums`). A run that reuses the
staging folder (an earlier run's publish failed) takes them back (`kept_checksums`), so publishing still checks
the staged bytes against what was written, not against themselves; without them the folder is not reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Optional

from merge_engine import storage
from merge_engine.errors import StepmergeError, UnsafeFile
from merge_engine.formats.json_file import read_json_object
from merge_engine.storage.source_files import walk_entries

logger = logging.getLogger(__name__)

# staging folders (`staging_url`) and the engine's temp siblings of them (`merge_engine.output.target`)
_STAGING_NAME = re.compile(r"^\.?[0-9a-f]{16}-[0-9a-f]{16}(\.stepmerge-.*)?$")
STALE_STAGING_S = float(os.environ.get("STEPMERGE_STALE_STAGING_S", str(6 * 3600)))


def default_staging_root() -> str:
    return os.environ.get("STEPMERGE_STAGING_DIR") or os.path.join(tempfile.gettempdir(), "stepmerge-staging")


def staging_url(staging_root: Optional[str], release: str, fingerprint: str) -> str:
    """A staging folder for one (release, fingerprint): stable across retries, distinct otherwise."""
    root = staging_root or default_staging_root()
    digest = hashlib.sha256(release.encode()).hexdigest()[:16]
    return storage.join(root, f"{digest}-{fingerprint[:16]}")


SUMS_SUFFIX = ".stepmerge-sums"  # the sibling folder of a staging folder holding its checksums
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _sums_url(staging: str) -> str:
    return storage.join(staging.rstrip("/") + SUMS_SUFFIX, "checksums.json")


def refuse_staged_links(url: str) -> None:
    """`UnsafeFile` naming the first link or special file (FIFO, socket, device) in the LOCAL folder ``url``, or
    ``url`` itself when it is a link: staging holds only the regular files the merge wrote, so a publish never
    copies a host file a link points to (whatever its size). Remote URLs pass: object stores hold no links."""
    if not storage.is_local(url):
        return
    root = storage.local_path(url).rstrip(os.sep) or os.sep
    if os.path.islink(root):
        raise UnsafeFile("the staging folder is a link: staging must be a folder of regular files", url)
    for entry in walk_entries(root):
        if entry.is_symlink() or not (entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False)):
            raise UnsafeFile("staging holds a link or special file where the merge wrote a regular file: never "
                             "copied", entry.path)


def _refuse_linked_sums(staging: str) -> None:
    """`UnsafeFile` when the sums folder beside a LOCAL ``staging`` (or its file) exists as a link or as anything
    but a folder (a file): it is never written through nor read from."""
    if not storage.is_local(staging):
        return
    folder = storage.local_path(staging.rstrip("/") + SUMS_SUFFIX)
    for path, kind in ((folder, os.path.isdir), (os.path.join(folder, "checksums.json"), os.path.isfile)):
        if os.path.islink(path) or (os.path.lexists(path) and not kind(path)):
            raise UnsafeFile("the staging folder's kept checksums are a link or not what was written: "
                             "never written through nor read", path)


def keep_checksums(staging: str, fingerprint: str, checksums: tuple[tuple[str, str], ...]) -> None:
    """Keep the shard jobs' ``checksums`` ((file, sha256) pairs) of the staging folder of build ``fingerprint``.
    `UnsafeFile` when the sums folder (or file) is there as a link (`_refuse_linked_sums`)."""
    _refuse_linked_sums(staging)
    document = {"fingerprint": fingerprint, "checksums": [list(pair) for pair in checksums]}
    storage.write_bytes(_sums_url(staging), json.dumps(document).encode())


def kept_checksums(staging: str, fingerprint: str) -> Optional[tuple[tuple[str, str], ...]]:
    """The checksums kept for the staging folder of build ``fingerprint``; None when none are kept, or they are of
    another build, or not a list of (file, sha256) pairs. `UnsafeFile` when they are a link."""
    _refuse_linked_sums(staging)
    try:
        document = read_json_object(_sums_url(staging))
    except StepmergeError:
        return None
    pairs = document.get("checksums") if document and document.get("fingerprint") == fingerprint else None
    if not isinstance(pairs, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str)
            and _SHA256.match(pair[1]) for pair in pairs):
        return None
    return tuple((name, digest) for name, digest in pairs)


def drop_checksums(staging: str) -> None:
    """Remove the checksums kept beside ``staging`` (its folder published or removed)."""
    storage.remove(staging.rstrip("/") + SUMS_SUFFIX, recursive=True)


def _newest_mtime(path: str) -> float:
    newest = os.stat(path).st_mtime
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def sweep_stale_staging(staging_root: Optional[str], keep: str = "", stale_s: Optional[float] = None) -> list[str]:
    """Remove staging folders of ours under a LOCAL ``staging_root`` not written to for ``stale_s``
    (default `STALE_STAGING_S`), except ``keep`` and its checksums; only names `staging_url` (or the engine's temp
    siblings, or `keep_checksums`) give are touched. Returns the removed paths. Remote staging roots are left alone."""
    root = staging_root or default_staging_root()
    if not storage.is_local(root):
        return []
    root = storage.local_path(root)
    limit = time.time() - (STALE_STAGING_S if stale_s is None else stale_s)
    keep_name = os.path.basename(keep.rstrip("/")) if keep else ""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if name in (keep_name, keep_name + SUMS_SUFFIX) or not _STAGING_NAME.match(name) or not os.path.isdir(path):
            continue
        try:
            if _newest_mtime(path) < limit:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                logger.info("removed stale staging folder %s", path)
        except FileNotFoundError:
            continue
    return removed
