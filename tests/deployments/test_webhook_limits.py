"""The webhook receiver holds no body it should not (issue 9, case 7), served for real by uvicorn.

Specification:
- an unauthenticated 600 MB chunked POST is refused (401) without the body being read: the
  receiver's peak RSS grows by less than 40 MB (it grew by 1.2 GB before);
- an authenticated (or HMAC-headed) body over 64 KiB is refused (413) as soon as it passes the cap,
  streamed or declared by Content-Length, again without the memory growing;
- a deeply nested JSON body is a 422 (it was a 500); a step beyond 10^12 is a 422.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from deployments.webhook import CHECKPOINT_SAVED_PATH, MAX_STEP

TOKEN = "limits-token-0123456789"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = b"x" * (1 << 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def receiver():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "STEPMERGE_WEBHOOK_TOKEN": TOKEN,
           "STEPMERGE_WEBHOOK_HMAC_SECRET": "limits-secret-0123456789", "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "deployments.webhook:create_app",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.3)
    else:
        server.kill()
        pytest.fail("the webhook receiver did not start")
    yield port, server.pid
    server.terminate()
    server.wait(10)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _chunked_post(port: int, headers: dict[str, str], megabytes: int) -> int:
    """POST ``megabytes`` MB with chunked transfer encoding; the status, or 0 if the server hung up."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.putrequest("POST", CHECKPOINT_SAVED_PATH)
    for key, value in {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **headers}.items():
        connection.putheader(key, value)
    connection.endheaders()
    try:
        for _ in range(megabytes):
            connection.send(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        connection.send(b"0\r\n\r\n")
    except OSError:
        pass  # the receiver answered and closed without reading the rest: what we want
    try:
        return connection.getresponse().status
    except OSError:
        return 0


def _post(port: int, body: bytes, headers: dict[str, str] | None = None) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", CHECKPOINT_SAVED_PATH, body=body,
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}",
                                **(headers or {})})
    return connection.getresponse().status


def test_big_bodies_are_never_held(receiver):
    port, pid = receiver
    before = _peak_rss_mb(pid)
    assert _chunked_post(port, {}, 600) in (401, 0)  # unauthenticated: refused, body unread
    assert _chunked_post(port, {"Authorization": f"Bearer {TOKEN}"}, 200) in (413, 0)  # over the cap
    signed = {"X-Stepmerge-Timestamp": str(int(time.time())), "X-Stepmerge-Signature": "sha256=00"}
    assert _chunked_post(port, signed, 200) in (413, 0)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:  # declares 1 GB, sends 10 bytes
        raw.sendall(f"POST {CHECKPOINT_SAVED_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {10**9}\r\n\r\n".encode() + b"{" * 10)
        assert raw.recv(64).startswith(b"HTTP/1.1 413")  # answered at once, not after a gigabyte
    assert _peak_rss_mb(pid) - before < 40, f"receiver grew from {before:.0f} MB to {_peak_rss_mb(pid):.0f} MB"


def test_nested_bodies_and_huge_steps_are_422(receiver):
    port, _ = receiver
    assert _post(port, b"[" * 30000 + b"]" * 30000) == 422
    assert _post(port, json.dumps({"run_root": "s3://b/run", "step": MAX_STEP + 1}).encode()) == 422
    assert _post(port, json.dumps({"run_root": "s3://b/run", "step": 10**30}).encode()) == 422
