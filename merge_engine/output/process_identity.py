"""Who wrote a claim, a temp folder or a lock, precisely enough to know when that writer is certainly dead.

A process id alone names a process only inside one PID namespace on one boot of one machine:
another container (another PID namespace), another host on a shared disk, or the same host after a
reboot reuses the same numbers. So a record (`current`) holds the host name, the kernel's boot id,
the PID namespace, the pid and the process start time (clock ticks since boot, from
``/proc/<pid>/stat``), and `certainly_dead` says True only when all of host, boot and namespace
are this process's own and the pid is gone or now belongs to a process started at another time.
Everywhere else (another namespace, host or boot; no ``/proc``) it says False and the caller must
decide by heartbeat age alone: a live writer refreshes its heartbeat, a dead one stops. The records
that carry this identity are `merge_engine.output.owner_record`'s (type-checked there before they get here).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping
from typing import Any


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _boot_id() -> str | None:
    return _read("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "(comm)": state is field 3
    except (ValueError, IndexError):
        return None


def current() -> dict[str, Any]:
    """This process's identity record (JSON-serialisable)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid_ns": _pid_namespace(), "pid": pid,
            "start": process_start(pid)}


def certainly_dead(record: Mapping[str, Any]) -> bool:
    """True only when the recorded process ran in this very host, boot and PID namespace and is gone
    (or its pid now names a process started at another time). False whenever that cannot be known."""
    me = current()
    if not me["boot_id"] or not me["pid_ns"]:
        return False
    if any(record.get(key) != me[key] for key in ("host", "boot_id", "pid_ns")):
        return False
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, someone else's: compare start times below
    started = process_start(pid)
    return started is not None and record.get("start") is not None and started != record.get("start")


__all__ = ["current", "certainly_dead", "process_start"]
