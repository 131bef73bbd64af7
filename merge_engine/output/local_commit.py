"""Local folders that appear whole or not at all: temp siblings with a live owner, committed by rename.

- `LiveFolder`: a sibling temp folder ``.<name>.stepmerge-<kind>-<id>`` of a target, with an owner
  record ``<temp>.owner.json`` (`merge_engine.output.owner_record`: identity + a heartbeat that a daemon thread
  refreshes every `HEARTBEAT_S` while the folder is in use).
- `sweep_dead_siblings`: removes temp siblings of a target whose owner is certainly dead (same host,
  boot and PID namespace, process gone) or whose heartbeat is older than `STALE_S` (any other
  host or namespace: decided by heartbeat age only, never by a pid; a heartbeat more than `STALE_S`
  in the future counts as stale too). A sibling without an owner record is judged by its own
  modification time; one whose record is malformed (not JSON, too big or deep, a field of the wrong
  type: never a live writer's, records are written whole) by the record file's modification time.
- `commit_folder`: puts a complete folder at the target in one step. If nothing is there, a
  rename; if something is (an older output being replaced, a concurrent writer's output), the two
  are swapped atomically (``renameat2(RENAME_EXCHANGE)``), so at every instant the target is either
  the whole old folder or the whole new one, and the old one ends in the temp name, deleted after.
  Where the kernel or filesystem cannot swap, the old folder is first renamed aside, then the new
  one into place: the target is absent for an instant, never mixed.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import threading
import time
import uuid

from merge_engine.output import owner_record
from merge_engine.errors import StepmergeError
from merge_engine.storage.json_text import read_local_json

HEARTBEAT_S = float(os.environ.get("STEPMERGE_TEMP_HEARTBEAT_S", "30"))
STALE_S = float(os.environ.get("STEPMERGE_TEMP_STALE_S", "600"))
OWNER_SUFFIX = ".owner.json"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temp_prefix(target: str) -> str:
    """The name prefix of every temp sibling of ``target`` (ours and other processes')."""
    return f".{os.path.basename(target.rstrip(os.sep))}.stepmerge-"


def _write_owner(path: str) -> None:
    body = owner_record.new_record()
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


class LiveFolder:
    """A temp sibling of ``target`` owned by this process while the context is open.

    On exit the folder (if still there: a commit moves it) and the owner record are removed.
    """

    def __init__(self, target: str, kind: str = "tmp") -> None:
        parent = os.path.dirname(target.rstrip(os.sep)) or "."
        self.path = os.path.join(parent, f"{temp_prefix(target)}{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.owner = self.path + OWNER_SUFFIX
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="stepmerge-temp-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                _write_owner(self.owner)
            except OSError:
                continue  # a full or flaky disk: the next beat retries

    def __enter__(self) -> LiveFolder:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        _write_owner(self.owner)  # before the folder: a folder never exists without its owner
        os.makedirs(self.path)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        if os.path.islink(self.path):  # an old target that was a link, swapped out by a commit
            _unlink(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        _unlink(self.owner)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _abandoned(path: str, now: float, dated: str | None = None) -> bool:
    """Whether the writer of temp folder ``path`` is gone: by its owner record, else by the
    modification time of ``dated`` (default ``path``) against `STALE_S`."""
    owner_file = path + OWNER_SUFFIX
    try:
        owner = owner_record.Owner.parse(read_local_json(owner_file))
    except FileNotFoundError:
        try:
            return now - os.lstat(dated or path).st_mtime > STALE_S
        except FileNotFoundError:
            return False
    except (OSError, StepmergeError):  # unreadable, not a regular file, not acceptable JSON
        owner = None
    if owner is None:
        try:
            return now - os.lstat(owner_file).st_mtime > STALE_S  # debris (records are written whole)
        except FileNotFoundError:
            return False
    return owner.stale(now, STALE_S)


def sweep_dead_siblings(target: str) -> list[str]:
    """Remove temp siblings of ``target`` left by writers that are dead (see the module docstring)."""
    parent = os.path.dirname(target.rstrip(os.sep)) or "."
    prefix = temp_prefix(target)
    removed = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    now = time.time()
    for name in names:
        if not name.startswith(prefix) or name.endswith(".tmp"):
            continue
        path = os.path.join(parent, name)
        if name.endswith(".old"):  # an old target set aside by a commit: its writer's owner decides
            if _abandoned(path[:-4], now, dated=path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        if name.endswith(OWNER_SUFFIX):
            if not os.path.lexists(path[: -len(OWNER_SUFFIX)]) and _abandoned(path[: -len(OWNER_SUFFIX)], now):
                _unlink(path)  # an owner record whose folder is gone
            continue
        try:
            if _abandoned(path, now):
                shutil.rmtree(path, ignore_errors=True)
                _unlink(path + OWNER_SUFFIX)
                removed.append(path)
        except OSError:
            continue
    return removed


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the kernel or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def commit_folder(folder: str, target: str) -> bool:
    """Put ``folder`` at ``target`` whole (see the module docstring). Returns True when an old
    ``target`` was replaced: it now lies at ``folder``'s path, for the caller to delete."""
    for _ in range(8):
        if not os.path.lexists(target):
            try:
                os.rename(folder, target)  # an empty folder at target is replaced too
                return False
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue  # a concurrent writer put its folder there first: swap with it
        if os.path.isdir(target) and not os.path.islink(target) and _exchange(folder, target):
            return True
        aside = f"{folder}.old"
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            continue
        try:
            os.rename(folder, target)
        except OSError:
            os.rename(aside, target) if not os.path.lexists(target) else None
            raise
        os.rename(aside, folder)  # the caller deletes the old folder under the temp name
        return True
    raise OSError(errno.EBUSY, "target keeps changing under concurrent writers", target)


__all__ = ["HEARTBEAT_S", "STALE_S", "LiveFolder", "commit_folder", "sweep_dead_siblings", "temp_prefix"]
