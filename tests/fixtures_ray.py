"""Session fixture: one real Ray cluster of this machine (``ray start --head``, 2 CPUs), shared by every test
that needs one, connected to from the test process once, stopped at the end of the session.

`LOOPBACK_RAY_ENV` keeps the cluster on this machine's loopback: Ray otherwise advertises the address of
the machine's network interface and connects to it, and these tests send traffic only to 127.0.0.1. Token
authentication is off for the same private cluster (a token file left by another Ray version made the
driver and the cluster disagree)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(LOOPBACK_RAY_ENV)  # Ray reads them when it is imported: before any test imports it


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of a running local Ray cluster; this process is connected to it."""
    import ray

    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    port = _free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = dict(os.environ)  # the cluster and this process (its driver) agree
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={root}"],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    address = f"127.0.0.1:{port}"
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        yield address
    finally:
        ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=120)
        shutil.rmtree(root, ignore_errors=True)
