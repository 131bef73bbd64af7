"""The owner record every lease stepmerge writes carries: publish claims, temp-folder owners, Prefect cache locks.

One shape, one reader, one staleness rule, so no lease is judged by a pid alone somewhere:
- `new_record(now, **extra)`: ``{**process_identity.current(), "heartbeat": now or time.time(), **extra}`` — host,
  boot id, PID namespace, pid, process start time, and the writer's clock when it wrote the record.
- `Owner.parse(value)`: the record type-checked, field by field: ``host`` a non-empty str; ``boot_id`` and
  ``pid_ns`` a str or null; ``pid`` an int in 1..`PID_LIMIT`; ``start`` an int >= 0 or null;
  ``heartbeat`` a finite number (JSON's ``1e999`` parses to infinity and is refused; a bool is not a number).
  None when any field is missing or wrong. Every record is written whole and atomically (temp name +
  rename or link, or one PUT), so a malformed one was never written by a live stepmerge: callers treat
  None as STALE (debris or forged), never as held, and never raise.
- `Owner.stale(now, ttl)`: True when the writer is certainly dead (`process_identity.certainly_dead`: this
  very host, boot and PID namespace, process gone or its pid reused), or its heartbeat is older than
  ``ttl``, or lies more than ``ttl`` in the future. Times are clamped: a heartbeat up to ``ttl`` ahead of
  this clock (a writer whose clock runs ahead) counts as written now, so such a record expires within
  two TTLs of its last write; one further ahead (a year-3000 heartbeat) is no writer's within the clock
  tolerance and is stale at once, instead of blocking forever. Clocks must agree within a TTL in both
  directions: a writer whose clock is behind by more already looks stale by age.
- `read_record(path_or_bytes, url)`: the JSON object of a record through the guarded parser
  (`merge_engine.storage.json_text`), or None when it is not an object or not acceptable JSON (too big, too deep).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from merge_engine.output import process_identity
from merge_engine.errors import StepmergeError
from merge_engine.storage.json_text import parse_json

PID_LIMIT = 2**31 - 1  # Linux's PID_MAX_LIMIT is 2**22; anything beyond a C int is no pid anywhere


def new_record(now: float | None = None, **extra: Any) -> dict[str, Any]:
    """This process's owner record, heartbeat ``now`` (default: `time.time()`), plus ``extra`` fields
    (JSON-serialisable)."""
    return {**process_identity.current(), "heartbeat": time.time() if now is None else now, **extra}


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond a double
        return None
    return number if math.isfinite(number) else None


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


@dataclass(frozen=True)
class Owner:
    """A type-checked owner record (see the module docstring)."""

    host: str
    boot_id: str | None
    pid_ns: str | None
    pid: int
    start: int | None
    heartbeat: float

    @classmethod
    def parse(cls, value: Any) -> Owner | None:
        if not isinstance(value, Mapping):
            return None
        host, boot_id, pid_ns = value.get("host"), value.get("boot_id"), value.get("pid_ns")
        pid, start, heartbeat = value.get("pid"), value.get("start"), finite_number(value.get("heartbeat"))
        if not isinstance(host, str) or not host or not _optional_str(boot_id) or not _optional_str(pid_ns):
            return None
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_LIMIT:
            return None
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            return None
        if heartbeat is None:
            return None
        return cls(host, boot_id, pid_ns, pid, start, heartbeat)

    def certainly_dead(self) -> bool:
        return process_identity.certainly_dead(asdict(self))

    def stale(self, now: float, ttl: float) -> bool:
        """Dead, or the heartbeat older than ``ttl`` or more than ``ttl`` ahead of ``now``."""
        return abs(now - self.heartbeat) > ttl or self.certainly_dead()


def read_record(data: str | bytes, url: str | None) -> dict[str, Any] | None:
    """The JSON object in ``data``, or None when it is not acceptable JSON or not an object."""
    try:
        value = parse_json(data, url)
    except StepmergeError:
        return None
    return value if isinstance(value, dict) else None


__all__ = ["PID_LIMIT", "Owner", "finite_number", "new_record", "read_record"]
