"""The lock manager behind SERIALIZABLE caching: exclusive, and never stuck on a crashed holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from tasks.locking import CrashSafeFileLockManager


def test_one_holder_at_a_time_and_the_next_gets_it_after_release(tmp_path):
    locks = CrashSafeFileLockManager(tmp_path)
    assert locks.acquire_lock("k", "A")
    assert locks.is_locked("k") and locks.is_lock_holder("k", "A") and not locks.is_lock_holder("k", "B")
    assert not locks.acquire_lock("k", "B", acquire_timeout=0.3)
    got = []
    waiter = threading.Thread(target=lambda: got.append(locks.acquire_lock("k", "B", acquire_timeout=10)))
    waiter.start()
    time.sleep(0.3)
    assert not got
    locks.release_lock("k", "A")
    waiter.join(10)
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
    locks = CrashSafeFileLockManager(tmp_path)
    assert locks.acquire_lock("k", "A", hold_timeout=0.2)
    assert not locks.acquire_lock("k", "B", acquire_timeout=0.05)
    time.sleep(0.3)
    assert locks.acquire_lock("k", "B", acquire_timeout=1)
    body = json.loads((tmp_path / "k.lock").read_text())
    assert body["holder"] == "B" and body["pid"] == os.getpid()


def test_two_breakers_of_one_stale_lock_never_both_win(tmp_path, monkeypatch):
    """A and B both find the same stale lock. B judges it stale and is paused right there; A breaks
    it and takes the lock (its new lock file may even get the old one's inode number); then B goes
    on. B must not remove A's lock: at most one of them holds it."""
    lock = tmp_path / "k.lock"
    a, b = CrashSafeFileLockManager(tmp_path), CrashSafeFileLockManager(tmp_path)
    assert a.acquire_lock("k", "crashed", hold_timeout=0.01)
    time.sleep(0.05)  # expired: stale
    stale_inode = os.stat(lock).st_ino
    b_judged, go_on = threading.Event(), threading.Event()
    real_stale = CrashSafeFileLockManager._stale

    def stale(info):
        verdict = real_stale(info)
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

    monkeypatch.setattr(CrashSafeFileLockManager, "_stale", staticmethod(stale))
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
