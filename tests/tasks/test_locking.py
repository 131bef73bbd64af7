"""The lock manager behind SERIALIZABLE caching: exclusive, and never stuck on a crashed holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from merge_engine.output.owner_record import new_record
from tasks.locking import POLL_S, CrashSafeFileLockManager
from tests.clock import HANG_S, ManualClock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_holder_at_a_time_and_the_next_gets_it_after_release(tmp_path):
    clock = ManualClock()
    locks = CrashSafeFileLockManager(tmp_path, clock=clock)
    assert locks.acquire_lock("k", "A")
    assert locks.is_locked("k") and locks.is_lock_holder("k", "A") and not locks.is_lock_holder("k", "B")
    assert not locks.acquire_lock("k", "B", acquire_timeout=0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(locks.acquire_lock("k", "B", acquire_timeout=600)))
    waiter.start()
    clock.until_waiting(1)  # B found the lock held and polls
    assert not got
    locks.release_lock("k", "A")
    clock.advance(POLL_S)  # B's next look
    waiter.join(HANG_S)
    assert got == [True] and locks.is_lock_holder("k", "B")


def test_racing_acquirers_never_both_win(tmp_path):
    locks = CrashSafeFileLockManager(tmp_path)
    winners = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        if locks.acquire_lock("race", f"holder-{i}", acquire_timeout=0):
            winners.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1


def test_a_lock_left_by_a_dead_process_is_broken(tmp_path):
    code = ("import sys; from pathlib import Path; from tasks.locking import CrashSafeFileLockManager; "
            "CrashSafeFileLockManager(Path(sys.argv[1])).acquire_lock('merge-key', 'crashed-worker')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)  # exits holding the lock
    locks = CrashSafeFileLockManager(tmp_path)
    assert json.loads((tmp_path / "merge-key.lock").read_text())["holder"] == "crashed-worker"
    assert not locks.is_locked("merge-key")
    assert locks.acquire_lock("merge-key", "next-run", acquire_timeout=1)


def test_an_expired_lock_is_broken_but_a_live_one_is_waited_for(tmp_path):
    clock = ManualClock(sleeps=False)
    locks = CrashSafeFileLockManager(tmp_path, clock=clock)
    assert locks.acquire_lock("k", "A", hold_timeout=3600)
    clock.advance(3599)
    assert not locks.acquire_lock("k", "B", acquire_timeout=0)  # A lives (this process) and holds it an hour
    clock.advance(2)
    assert locks.acquire_lock("k", "B", acquire_timeout=0)
    body = json.loads((tmp_path / "k.lock").read_text())
    assert body["holder"] == "B" and body["pid"] == os.getpid()


def test_two_breakers_of_one_stale_lock_never_both_win(tmp_path, monkeypatch):
    """A and B both find the same stale lock. B judges it stale and is paused right there; A breaks
    it and takes the lock (its new lock file may even get the old one's inode number); then B goes
    on. B must not remove A's lock: at most one of them holds it."""
    lock = tmp_path / "k.lock"
    a, b = CrashSafeFileLockManager(tmp_path), CrashSafeFileLockManager(tmp_path)
    assert a.acquire_lock("k", "crashed", hold_timeout=0)  # expired at once: stale
    stale_inode = os.stat(lock).st_ino
    b_judged, go_on = threading.Event(), threading.Event()
    real_stale = CrashSafeFileLockManager._stale

    def stale(self, info):
        verdict = real_stale(self, info)
        if verdict and threading.current_thread().name == "breaker-b" and not b_judged.is_set():
            b_judged.set()
            go_on.wait(10)
        return verdict

    real_stat = os.stat

    def stat(path, *args, **kwargs):  # the inode number of a removed file is free for the next one
        result = real_stat(path, *args, **kwargs)
        if threading.current_thread().name == "breaker-b" and str(path) == str(lock):
            return type("Stat", (), {"st_ino": stale_inode, "st_mtime": result.st_mtime})()
        return result

    monkeypatch.setattr(CrashSafeFileLockManager, "_stale", stale)
    monkeypatch.setattr(os, "stat", stat)
    got_b = []
    breaker_b = threading.Thread(target=lambda: got_b.append(b.acquire_lock("k", "B", acquire_timeout=3)),
                                 name="breaker-b")
    breaker_b.start()
    assert b_judged.wait(10)
    got_a = a.acquire_lock("k", "A", acquire_timeout=0.5)
    go_on.set()
    breaker_b.join(10)
    assert not (got_a and got_b[0]), "both hold the lock"
    holder = json.loads(lock.read_text())["holder"]
    assert holder == ("A" if got_a else "B")


def test_lock_file_debris_is_an_expired_lock(tmp_path):
    """A lock file that is not a JSON object (a list, bytes that are not UTF-8, nesting past the parser)
    is debris: broken, never a crash of the run that finds it."""
    locks = CrashSafeFileLockManager(tmp_path)
    for debris in (b"[1]", b"\xff", b"[" * 100_000):
        (tmp_path / "k.lock").write_bytes(debris)
        assert not locks.is_locked("k")
        assert locks.acquire_lock("k", "A", acquire_timeout=1)
        assert locks.is_lock_holder("k", "A")
        locks.release_lock("k", "A")


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _write_lock(path, **fields) -> dict:
    """A lock file as a holder of this host would write it (`merge_engine.output.owner_record`), fields replaced."""
    body = {**new_record(holder="someone"), "expires": time.time() + 3600, **fields}
    path.write_text(json.dumps(body))
    return body


def test_a_holder_in_another_pid_namespace_is_not_judged_by_its_pid(tmp_path):
    """Issue 17 point 3: the lock's pid names a process of ANOTHER PID namespace, dead here: that says
    nothing about the holder, whose lock is waited for (until it expires). The same record from this
    namespace is a dead holder, broken at once."""
    locks = CrashSafeFileLockManager(tmp_path)
    _write_lock(tmp_path / "k.lock", pid=_dead_pid(), pid_ns="pid:[4026531000]")
    assert locks.is_locked("k")
    assert not locks.acquire_lock("k", "outsider", acquire_timeout=0.3)
    _write_lock(tmp_path / "k.lock", pid=_dead_pid())  # this namespace, process gone
    assert not locks.is_locked("k")
    assert locks.acquire_lock("k", "next", acquire_timeout=1)


OUTSIDER = ("import sys; from pathlib import Path; from tasks.locking import CrashSafeFileLockManager; "
            "print(CrashSafeFileLockManager(Path(sys.argv[1])).acquire_lock('k', 'outsider', acquire_timeout=0.5))")


def test_an_outsider_in_another_pid_namespace_waits_for_a_live_holder(tmp_path):
    """Issue 17 point 3, with a real PID namespace (`unshare`): this live process holds the lock; a process
    of another namespace, where this pid names nothing, must not break it."""
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("unshare of a PID namespace is not permitted here (the test above covers the record)")
    locks = CrashSafeFileLockManager(tmp_path)
    assert locks.acquire_lock("k", "here")
    outsider = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", OUTSIDER,
                               str(tmp_path)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": REPO})
    assert outsider.stdout.strip() == "False", outsider.stderr[-2000:]
    assert locks.is_lock_holder("k", "here")


@pytest.mark.parametrize("fields", [
    {"expires": "soon"}, {"pid": "abc"}, {"pid": 10**30}, {"expires": None}, {"heartbeat": "now"},
    {"holder": ["x"]}, {"heartbeat": time.time() + 10 * 365 * 86400},  # a clock ten years ahead, or forged
    {"expires": time.time() + 10**9},  # asks for 30 years: clamped to the hold limit from its heartbeat...
])
def test_a_malformed_lock_record_is_stale_never_an_exception(tmp_path, fields):
    """Issue 17 point 11: a lock record with a field of the wrong type, out of range, or a time far in the
    future is debris (locks are written whole, so no live holder wrote it): broken by the next acquirer,
    never a ValueError / OverflowError, never a lock that blocks for ever."""
    locks = CrashSafeFileLockManager(tmp_path, hold_timeout_s=60)
    if "expires" in fields and isinstance(fields["expires"], float):  # ...which is long past for this record
        fields = {**fields, "heartbeat": time.time() - 2 * 86400}
    _write_lock(tmp_path / "k.lock", **fields)
    assert not locks.is_locked("k")
    assert locks.acquire_lock("k", "A", acquire_timeout=1) and locks.is_lock_holder("k", "A")


def test_an_infinite_expiry_does_not_block_for_ever(tmp_path):
    """Issue 17 point 11: ``expires: 1e999`` (JSON for infinity) used to hold the lock until someone deleted
    the file. The same record with a finite expiry and a live holder (this process) is a held lock."""
    locks = CrashSafeFileLockManager(tmp_path)
    body = _write_lock(tmp_path / "k.lock", pid=os.getpid())
    assert locks.is_locked("k") and not locks.acquire_lock("k", "B", acquire_timeout=0.2)
    (tmp_path / "k.lock").write_text(json.dumps(body).replace(repr(body["expires"]), "1e999"))
    assert json.loads((tmp_path / "k.lock").read_text())["expires"] == float("inf")
    assert not locks.is_locked("k")
    assert locks.acquire_lock("k", "B", acquire_timeout=1)


def test_a_lock_file_that_is_a_fifo_is_debris_not_a_hang(tmp_path):
    """A FIFO at the lock's name is opened non-blocking and refused: never waited on; it is broken."""
    locks = CrashSafeFileLockManager(tmp_path)
    os.mkfifo(tmp_path / "k.lock")
    verdict = []
    reader = threading.Thread(target=lambda: verdict.append(locks.is_locked("k")), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # release a blocking open, so the thread ends
        os.close(os.open(tmp_path / "k.lock", os.O_WRONLY | os.O_NONBLOCK))
    assert verdict == [False], "the lock manager waited on a FIFO"
    assert locks.acquire_lock("k", "A", acquire_timeout=1)
