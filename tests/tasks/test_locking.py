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
