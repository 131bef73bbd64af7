"""A file lock manager for Prefect's SERIALIZABLE cache isolation that survives crashed holders
(why not Prefect's own `FileSystemLockManager`, and the arguments behind the rules: docs/publishing.md):
- a lock is a file ``<dir>/<key>.lock`` holding an owner record (`merge_engine.output.owner_record`, the
  same record publish claims and temp folders carry: host, boot id, PID namespace, pid, process
  start time, heartbeat = when it was taken) plus ``holder`` and ``expires``, created whole and
  atomically (written under a temp name, then hard-linked into place: the link fails if the lock
  exists, so exactly one of two racing acquirers wins);
- a lock is stale, and is broken by the next acquirer, when its holder is certainly dead (this very
  host, boot and PID namespace, process gone or its pid reused: a holder in another container is
  never judged by a pid that means another process here), or it expired (``hold_timeout``, default
  `DEFAULT_HOLD_S`: longer than any merge). Every field is type-checked and every time clamped: a
  record that is not one (``expires: "soon"``, ``pid: 10**30``, ``expires: 1e999``, a deeply nested
  file) is stale (broken, never raised). A lock's life counts from its heartbeat
  and is at most the larger of this manager's ``hold_timeout_s`` and `DEFAULT_HOLD_S`, whatever its
  ``expires`` says; a heartbeat further in the future than that life is stale at once. A live
  holder elsewhere (another host or namespace) is waited for until its lock expires;
- every removal of a lock file (breaking a stale lock, releasing one's own) happens under an
  exclusive ``flock`` on ``<dir>/.locks.guard``, after reading the lock again under it: the lock
  file read is the one removed, so two acquirers that saw one stale lock cannot both break it. An
  acquirer that finds the guard busy treats the lock as held and polls;
- ``directory`` defaults to ``$STEPMERGE_LOCK_DIR``, else ``.locks`` inside Prefect's local
  result storage path, resolved at each call (so it follows test and profile settings).
It serialises runs that share the directory (one machine, or a shared filesystem). Across machines
without one, the engine's publish claims still keep a release single-writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import anyio
from prefect.locking.protocol import LockManager

from merge_engine.errors import StepmergeError
from merge_engine.storage.json_text import read_local_json
from merge_engine.output.clock import SYSTEM_CLOCK, Clock
from merge_engine.output.owner_record import Owner, finite_number, new_record

DEFAULT_HOLD_S = 24 * 3600.0
POLL_S = 0.1
GUARD_FILE = ".locks.guard"


def default_lock_directory() -> Path:
    configured = os.environ.get("STEPMERGE_LOCK_DIR")
    if configured:
        return Path(configured).expanduser()
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH

    return Path(PREFECT_RESULTS_LOCAL_STORAGE_PATH.value()).expanduser() / ".locks"


class CrashSafeFileLockManager(LockManager):
    """See the module docstring. Thread- and process-safe on one filesystem."""

    def __init__(self, directory: Optional[Path] = None, hold_timeout_s: float = DEFAULT_HOLD_S,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._directory = directory
        self.hold_timeout_s = hold_timeout_s
        self.clock = clock  # where heartbeats, expiry and the waits read the time (`merge_engine.output.clock`)

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else default_lock_directory()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.lock"

    def _read(self, key: str) -> Optional[dict]:
        """The lock's record, or None when there is no lock; ``{}`` for debris (stale: see `_stale`)."""
        path = self._path(key)
        try:
            info = read_local_json(str(path))
        except FileNotFoundError:
            return None
        except (OSError, StepmergeError):  # not a regular file, unreadable, not acceptable JSON
            return {}
        return info if isinstance(info, dict) else {}  # never written partially: debris is an expired lock

    @contextlib.contextmanager
    def _guard(self, blocking: bool = True) -> Iterator[bool]:
        """The directory's removal guard (an exclusive flock); yields False when busy and not ``blocking``."""
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / GUARD_FILE, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the flock

    def _stale(self, info: dict) -> bool:
        """Debris, expired, or its holder certainly dead (see the module docstring)."""
        owner, expires = Owner.parse(info), finite_number(info.get("expires"))
        if owner is None or expires is None or not isinstance(info.get("holder"), str):
            return True
        life = min(expires - owner.heartbeat, max(self.hold_timeout_s, DEFAULT_HOLD_S))
        return life <= 0 or owner.stale(self.clock.time(), life)

    def _create(self, key: str, holder: str, hold_timeout: Optional[float]) -> bool:
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        hold = self.hold_timeout_s if hold_timeout is None else hold_timeout
        body = new_record(self.clock.time(), holder=holder)
        body["expires"] = body["heartbeat"] + hold
        temp = directory / f".{key}.{uuid.uuid4().hex}.tmp"
        temp.write_bytes(json.dumps(body).encode())
        try:
            os.link(temp, self._path(key))
            return True
        except FileExistsError:
            return False
        finally:
            temp.unlink(missing_ok=True)

    def _break_if_stale(self, key: str) -> bool:
        """Remove the lock if it is stale; True when the caller should try to acquire again.

        Under the guard (see the module docstring); a busy guard counts as a held lock (False).
        """
        with self._guard(blocking=False) as guarded:
            if not guarded:
                return False
            info = self._read(key)  # read again under the guard: the file removed is the file judged
            if info is None:
                return True
            if not self._stale(info):
                return False
            self._path(key).unlink(missing_ok=True)
            return True

    def _try_acquire(self, key: str, holder: str, hold_timeout: Optional[float]) -> Optional[bool]:
        """True: acquired (or already ours); False: held by a live holder; None: try again now."""
        if self._create(key, holder, hold_timeout):
            return True
        info = self._read(key)
        if info is not None and info.get("holder") == holder:
            return True
        return None if self._break_if_stale(key) else False

    def acquire_lock(self, key: str, holder: str, acquire_timeout: Optional[float] = None,
                     hold_timeout: Optional[float] = None) -> bool:
        deadline = None if acquire_timeout is None else self.clock.monotonic() + acquire_timeout
        while True:
            got = self._try_acquire(key, holder, hold_timeout)
            if got:
                return True
            if got is None:
                continue
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(POLL_S)

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout: Optional[float] = None,
                            hold_timeout: Optional[float] = None) -> bool:
        deadline = None if acquire_timeout is None else self.clock.monotonic() + acquire_timeout
        while True:
            got = self._try_acquire(key, holder, hold_timeout)
            if got:
                return True
            if got is None:
                continue
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            await anyio.sleep(POLL_S)

    def release_lock(self, key: str, holder: str) -> None:
        with self._guard():
            info = self._read(key)
            if info is None or info.get("holder") != holder:
                raise ValueError(f"No lock held by {holder} for transaction with key {key}")
            self._path(key).unlink(missing_ok=True)

    def is_locked(self, key: str) -> bool:
        info = self._read(key)
        return info is not None and not self._stale(info)

    def is_lock_holder(self, key: str, holder: str) -> bool:
        info = self._read(key)
        return info is not None and info.get("holder") == holder and not self._stale(info)

    def wait_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else self.clock.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(POLL_S)
        return True

    async def await_for_lock(self, key: str, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else self.clock.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            await anyio.sleep(POLL_S)
        return True
