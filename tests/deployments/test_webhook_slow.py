"""The webhook receiver bounds what an unauthenticated sender can hold, served for real by uvicorn (loopback).

Specification:
- 100 connections that send a made-up HMAC signature, a fresh timestamp and a few bytes of a declared body, then
  nothing, are all answered and closed by the receiver within 30 s: `MAX_UNVERIFIED_READS` of them with 408 at
  the body deadline (`BODY_DEADLINE_S`), the others at once with 503;
- each such request, and each sender that hangs up mid-body, is one ``refused`` line in the receiver's log, and
  the log holds no traceback.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time

import pytest

from deployments.webhook import BODY_DEADLINE_S, CHECKPOINT_SAVED_PATH, MAX_UNVERIFIED_READS
from tests.deployments.test_webhook_limits import REPO, _free_port

SLOW = 100


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("webhook") / "receiver.log"
    env = {**os.environ, "PYTHONPATH": REPO, "STEPMERGE_WEBHOOK_TOKEN": "slow-token-0123456789",
           "STEPMERGE_WEBHOOK_HMAC_SECRET": "slow-secret-0123456789", "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "deployments.webhook:create_app",
                                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                break
        except OSError:
            time.sleep(0.3)
    else:
        server.kill()
        pytest.fail(f"the webhook receiver did not start: {log.read_text()[-2000:]}")
    yield port, log
    server.terminate()
    server.wait(10)


def _slow_sender(port: int) -> socket.socket:
    """A connection that sends a signature-headed request and 10 of its 1000 body bytes, then nothing."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(f"POST {CHECKPOINT_SAVED_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"X-Stepmerge-Timestamp: {int(time.time())}\r\nX-Stepmerge-Signature: sha256={'0' * 64}\r\n"
                       f"Content-Length: 1000\r\n\r\n{{\"run_root\"".encode())
    connection.setblocking(False)
    return connection


def _refusals(log) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("refused ")]


def _wait_for_refusals(log, count: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while len(_refusals(log)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return _refusals(log)


def test_slow_unauthenticated_senders_are_closed_within_30_s(receiver):
    port, log = receiver
    logged = len(_refusals(log))
    started = time.monotonic()
    senders = selectors.DefaultSelector()
    for _ in range(SLOW):
        senders.register(_slow_sender(port), selectors.EVENT_READ, bytearray())
    closed: dict[int, bytes] = {}
    while len(closed) < SLOW and time.monotonic() - started < 30:
        for key, _ in senders.select(timeout=1):
            try:
                chunk = key.fileobj.recv(4096)
            except ConnectionResetError:
                chunk = b""
            key.data.extend(chunk)
            if not chunk:  # the receiver closed it
                closed[key.fileobj.fileno()] = bytes(key.data)
                senders.unregister(key.fileobj)
                key.fileobj.close()
    for key in list(senders.get_map().values()):
        key.fileobj.close()
    took = time.monotonic() - started
    assert len(closed) == SLOW, f"{SLOW - len(closed)} of {SLOW} slow connections still open after {took:.0f} s"
    statuses = sorted(answer.split(b" ", 2)[1].decode() for answer in closed.values())
    assert statuses.count("408") == MAX_UNVERIFIED_READS and statuses.count("503") == SLOW - MAX_UNVERIFIED_READS
    assert took < BODY_DEADLINE_S + 15
    lines = _wait_for_refusals(log, logged + SLOW, 10)[logged:]
    assert len(lines) == SLOW and all(": 408 " in line or ": 503 " in line for line in lines), lines[:3]


def test_a_sender_that_hangs_up_mid_body_is_one_line_and_no_traceback(receiver):
    port, log = receiver
    logged = len(_refusals(log))
    for _ in range(3):
        _slow_sender(port).close()
    lines = _wait_for_refusals(log, logged + 3, 20)[logged:]
    assert len(lines) == 3 and all(": 400 the sender closed the connection" in line for line in lines), lines
    assert "Traceback" not in log.read_text()
