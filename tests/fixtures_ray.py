"""Session fixture: one real multi-node Ray cluster of this machine, shared by every test that needs Ray:
a head (``ray start --head``, no CPU) and two worker nodes ``a`` and ``b`` (``ray start --address``, 1 CPU
each, their own temp dirs), each node its own process group, so a test can kill one whole node and only
it (`LocalRayCluster.kill_node`, then `start_nodes` to bring it back). Connected to from the test process
once, stopped at the end of the session (process group by process group: other Ray clusters of the
machine live on).

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
from dataclasses import dataclass

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


def _stop_sessions(processes: list[subprocess.Popen], grace: float = 2.0) -> None:
    """Stop these clusters (or nodes) and only them: every process of each session ``ray start`` leads (its
    GCS, raylet, agents and workers); never ``ray stop``, which stops every Ray cluster of the machine, other
    test sessions' included. SIGTERM, then SIGKILL to what is left of each group after one ``grace`` for all
    of them (``grace=0``: SIGKILL at once)."""
    signalled = []
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM if grace else signal.SIGKILL)
            signalled.append(process)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for process in signalled if grace else ():
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait()


def start_ray_head(root: str, port: int, env: dict[str, str] | None = None, num_cpus: int = 2) -> subprocess.Popen:
    """``ray start --head --block`` (``num_cpus`` CPUs, temp dir ``root``) in its own process group, once it
    listens on ``port``; stop it with `stop_ray_head`."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
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
    """Stop that cluster alone (`_stop_sessions`), with SIGKILL at once: ``ray start --head --block`` does not
    exit on SIGTERM (measured, Ray 2.60 here: still running 15 s after), so a grace only delayed the
    SIGKILL that always followed."""
    _stop_sessions([head], grace=0)


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


# Worker nodes join with the multi-node switch on (Ray refuses it otherwise) but keep to loopback:
# --node-ip-address pins where they listen, and `_NODE_LAUNCHER` stops `ray start` from replacing
# 127.0.0.1 in --address by the machine's network address (which the loopback head does not listen on).
_WORKER_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
_NODE_LAUNCHER = ("import sys; from ray._private import services; services.resolve_ip_for_localhost = lambda host: host; "
                  "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()")
# The head notices a node that stopped answering within ~3 s (Ray's default: 30 s): a test that kills a
# node waits for that state. Ray reads RAY_<setting> in every process it starts.
_HEAD_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
             "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "0"}
WORKER_NODES = ("a", "b")  # 1 CPU each; the head has none, so every task runs on a worker node


@dataclass
class RayNode:
    """One worker node: ``ray start --address --block`` in its own process group (its raylet, agents and
    workers), its own temp dir, 1 CPU; ``node_id`` as the cluster knows it."""

    name: str
    process: subprocess.Popen
    node_id: str

    @property
    def session(self) -> int:
        return self.process.pid


class LocalRayCluster:
    """A head (no CPU) and named worker nodes, each a separate Ray node of this machine (see the module
    docstring); this process is the driver."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head = start_ray_head(root, self.port, _HEAD_ENV, num_cpus=0)
        self.nodes: dict[str, RayNode] = {}
        self.pending: dict[str, subprocess.Popen] = {}  # nodes started, not yet listed alive

    def sessions(self) -> set[int]:
        """The process sessions of the cluster (head and every node started): what a test that signals
        a process filters on, so that it never touches another Ray cluster of the machine."""
        return {self.head.pid, *(node.session for node in self.nodes.values()),
                *(process.pid for process in self.pending.values())}

    def start_nodes(self, names: tuple[str, ...], timeout: float = 300.0, wait: bool = True) -> None:
        """Start worker nodes ``names`` together and wait until the head lists each alive; ``wait=False``:
        return at once (a node restarted for later tests: they wait for it with `wait_for_nodes`; its
        processes are the cluster's from the start, `sessions`)."""
        for name in names:
            temp = os.path.join(self.root, name)
            self.pending[name] = subprocess.Popen(
                [sys.executable, "-c", _NODE_LAUNCHER, "start", "--block", f"--address={self.address}",
                 "--num-cpus=1", "--node-ip-address=127.0.0.1", f"--node-name={name}", "--disable-usage-stats",
                 f"--temp-dir={temp}"],
                env={**os.environ, **LOOPBACK_RAY_ENV, **_WORKER_NODE_ENV}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
        if wait:
            self.wait_for_nodes(timeout)

    def wait_for_nodes(self, timeout: float = 300.0) -> None:
        """Wait until every node started is listed alive by the head (then it is in `nodes`)."""
        import ray

        processes = self.pending
        deadline = time.monotonic() + timeout
        try:
            while processes:
                known = {node.node_id for node in self.nodes.values()}
                alive = {n["NodeName"]: n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeName"] in processes
                         and n["NodeID"] not in known}
                for name in list(processes):
                    if name in alive:
                        self.nodes[name] = RayNode(name, processes.pop(name), alive[name])
                    elif processes[name].poll() is not None:
                        raise RuntimeError(f"Ray worker node {name} exited with {processes[name].returncode}")
                if processes and time.monotonic() > deadline:
                    raise TimeoutError(f"Ray worker nodes {sorted(processes)} did not join within {timeout:.0f} s")
                if processes:
                    time.sleep(0.1)
        except BaseException:
            _stop_sessions(list(processes.values()))
            processes.clear()
            raise

    def kill_node(self, name: str, timeout: float = 120.0) -> None:
        """SIGKILL every process of worker node ``name`` (its process group) and wait until the head has
        marked it dead."""
        import ray

        node = self.nodes.pop(name)
        try:
            os.killpg(node.session, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.process.wait()
        deadline = time.monotonic() + timeout
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head still lists node {name} alive {timeout:.0f} s after it was killed")
            time.sleep(0.1)

    def stop(self) -> None:
        # the worker nodes together, while the head lives (a node exits on SIGTERM in ~1 s then; with its head
        # going away too, it waited for it half a minute), then the head
        _stop_sessions([*(node.process for node in self.nodes.values()), *self.pending.values()])
        self.nodes.clear()
        self.pending.clear()
        stop_ray_head(self.head)


@pytest.fixture(scope="session")
def ray_local_cluster() -> Iterator[LocalRayCluster]:
    """The session's Ray cluster: a head and worker nodes `WORKER_NODES`, each a separate Ray node in its
    own process group with its own temp dir, started once; this process is connected to it (the driver)."""
    import ray

    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    cluster = None
    try:
        cluster = LocalRayCluster(root)  # the cluster and this process (its driver) agree on the environment
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.start_nodes(WORKER_NODES)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(ray_local_cluster: LocalRayCluster) -> str:
    """The address of the session's Ray cluster (`ray_local_cluster`); this process is connected to it."""
    return ray_local_cluster.address
