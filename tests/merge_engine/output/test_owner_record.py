"""`merge_engine.output.owner_record`: the one owner record of claims, temp folders and locks (issue 17, points 10-12).

Specification:
- every field is type-checked: a record with a field of the wrong type or out of range (a pid that is a
  string or 10**30, a heartbeat that is a string, a bool or ``1e999``, which JSON parses to infinity) is
  not a record (`Owner.parse` -> None), never an exception;
- times are clamped: a heartbeat up to one TTL in the future (a writer whose clock runs ahead) counts
  as now and keeps the record live; one further ahead is stale at once; one older than a TTL is stale;
- a record of this very process is live, one of a dead process in this host, boot and PID namespace is
  stale whatever its heartbeat, one from another namespace is judged by its heartbeat only;
- records are read through the guarded parser: deep nesting, huge or non-UTF-8 data are None.
"""

from __future__ import annotations

import json
import subprocess
import time

from merge_engine.output.owner_record import Owner, new_record, read_record


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_every_field_is_type_checked():
    good = new_record(attempt="a")
    assert Owner.parse(good) is not None and Owner.parse(good).pid == good["pid"]
    for field, bad in [("pid", "abc"), ("pid", 10**30), ("pid", 0), ("pid", -1), ("pid", True), ("pid", 1.5),
                       ("heartbeat", "soon"), ("heartbeat", float("inf")), ("heartbeat", float("nan")),
                       ("heartbeat", True), ("heartbeat", 10**400), ("heartbeat", None), ("host", ""), ("host", 3),
                       ("boot_id", ["x"]), ("pid_ns", 7), ("start", "early"), ("start", -5), ("start", False)]:
        assert Owner.parse({**good, field: bad}) is None, (field, bad)
    for missing in ("host", "pid", "heartbeat"):
        assert Owner.parse({k: v for k, v in good.items() if k != missing}) is None
    assert Owner.parse([good]) is None and Owner.parse(None) is None
    assert read_record(b'{"heartbeat": 1e999}', "x") == {"heartbeat": float("inf")}
    assert Owner.parse(read_record(json.dumps(good).replace(str(good["heartbeat"]), "1e999"), "x")) is None


def test_times_are_clamped_and_the_future_is_bounded():
    now = time.time()
    elsewhere = {**new_record(), "host": "another-host"}  # judged by heartbeat alone
    ttl = 600.0

    def stale(heartbeat: float) -> bool:
        return Owner.parse({**elsewhere, "heartbeat": heartbeat}).stale(now, ttl)

    assert not stale(now) and not stale(now - ttl + 1)
    assert stale(now - ttl - 1)  # not refreshed for a TTL: its writer is gone
    assert not stale(now + 60)  # a clock a minute ahead: counts as now, expires once this clock passes it + TTL
    assert stale(now + ttl + 1) and stale(now + 3600) and stale(1e300)  # no writer's clock is that far ahead


def test_identity_decides_before_the_heartbeat():
    now = time.time()
    me = Owner.parse(new_record())
    assert not me.stale(now, 600)
    dead_here = Owner.parse({**new_record(), "pid": _dead_pid()})
    assert dead_here.stale(now, 600)  # this host, boot and namespace, process gone: stale at once
    dead_elsewhere = Owner.parse({**new_record(), "pid": _dead_pid(), "pid_ns": "pid:[1]"})
    assert not dead_elsewhere.stale(now, 600)  # that pid means another process there: wait for the heartbeat
    assert dead_elsewhere.stale(now + 601, 600)


def test_records_are_read_through_the_guarded_parser():
    assert read_record(b"[" * 100_000 + b"]" * 100_000, "x") is None  # Python's parser: RecursionError
    assert read_record(b'{"a":' * 65 + b"1" + b"}" * 65, "x") is None  # deeper than any record
    assert read_record(b"\xff", "x") is None and read_record(b"[1]", "x") is None
    assert read_record(b'{"a": "[[[[["}', "x") == {"a": "[[[[["}  # brackets inside strings do not count
