"""Session fixture: one real Ray cluster of this machine (``ray start --head``, 2 CPUs), shared by every test
that needs one, connected to from the test process once, stopped at the end of the session (its own
process group, so that only this cluster is stopped: other Ray clusters of the machine live on).

`LOOPBACK_RAY_ENV` keeps the cluster on this machine's loopback: Ray otherwise advertises the address of
the machine's network interface and connects to it, and these tests send traffic only to 127.0.0.1. Token
authentication is off for the same private cluster (a token file left by another Ray version made the
driver and the cluster disagree)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(LOOPBACK_RAY_ENV)  # Ray reads them when it is imported: before any test imports it


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not listen on port {port} within {timeout:.0f} s")


def _stop_session(process: subprocess.Popen, grace: float = 2.0) -> None:
    """Stop this cluster and only it: every process of the session ``ray start`` leads (its GCS, raylet,
    agents and workers); never ``ray stop``, which stops every Ray cluster of the machine, other
    test sessions' included. SIGTERM, then SIGKILL to what is left of the group."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def start_ray_head(root: str, port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``ray start --head --block`` (2 CPUs, temp dir ``root``) in its own process group, once it listens
    on ``port``; stop it with `stop_ray_head`."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={root}"],
                            env={**os.environ, **LOOPBACK_RAY_ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(port, head)
    except BaseException:
        stop_ray_head(head)
        raise
    return head


def stop_ray_head(head: subprocess.Popen) -> None:
    """Stop that cluster alone (`_stop_session`)."""
    _stop_session(head)


def worker_peak_rss_mb(head: subprocess.Popen) -> list[float]:
    """Peak RSS (VmHWM, MB) of each Ray worker process (``ray::...``, not its agents) of that cluster."""
    import psutil

    peaks = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(process.pid) != head.pid:
                continue
            title = " ".join(process.info["cmdline"] or [])
            if not title.startswith("ray::") or "Agent" in title:
                continue
            with open(f"/proc/{process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peaks.append(int(line.split()[1]) / 1024)
        except (OSError, psutil.Error):
            continue
    return peaks


@pytest.fixture(scope="session")
def ray_cluster_session(ray_cluster: str) -> int:
    """The session id of every process of the `ray_cluster` (its GCS, raylet, workers): what a test that
    signals a worker filters on, so that it never touches another Ray cluster of the machine."""
    return _SESSIONS[ray_cluster]


_SESSIONS: dict[str, int] = {}  # address -> session id (= pid of its ``ray start``)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of a running local Ray cluster; this process is connected to it."""
    import ray

    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    port = free_port()
    head = start_ray_head(root, port)  # the cluster and this process (its driver) agree on the environment
    address = f"127.0.0.1:{port}"
    _SESSIONS[address] = head.pid
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        yield address
    finally:
        ray.shutdown()
        stop_ray_head(head)
        shutil.rmtree(root, ignore_errors=True)
