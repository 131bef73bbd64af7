"""Shard jobs on a real multi-node Ray cluster; a wrong Ray address fails at once (issue 19, point 4).

Specification, on the session's cluster (`tests.fixtures_ray`: a head with no CPU and worker nodes ``a``
and ``b``, 1 CPU each, each a separate Ray node in its own process group with its own temp dir) and the
session's SeaweedFS:
- a merge from ``s3://``: every shard task ran on a worker node, never the head, and both worker nodes
  took shards (node ids from the executor's task records); each task read at least its shard's tensor
  bytes from the storage URL itself (its own reads, counted in its worker), while the coordinator read
  only metadata (under a quarter of the weights' bytes); the output is byte-identical to the one-worker local merge;
- a whole worker node (its process group: raylet, agents, workers) SIGKILLed while a shard task runs on
  it (the storage held still from the first task's start until the kill, so no task can finish first):
  Ray runs the lost task again on the node left, the merge completes byte-identical to the local merge,
  and no temp file is left; the node is started again (not waited for) for the tests after it;
- ``--ray-address`` (`RayExecutor.at`) connects and starts one worker per cluster CPU (importing the shard job) in
  the background while the coordinator checks and plans: in a fresh process, every unit task then ran on one of
  those workers, and the output is byte-identical to the local merge;
- a job with fewer tasks than the cluster's CPUs gives each task its share, at most a node's
  (`threads_per_task`); the task writes its byte ranges on that many threads;
- ``--ray-address`` naming no Ray cluster (a closed port, a web server's port) or no address at all
  (garbage, a port out of range, a web URL): the command exits non-zero with one line naming the error
  (`RayClusterUnreachable` / `InvalidOption`) and the address, within 10 s, and writes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from merge_engine import storage
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.output.executors.ray import RayExecutor, threads_per_task
from merge_engine.output.jobs import OutputOptions, run_job
from merge_engine.commands.merge import MergeJob
from merge_engine.storage.range_reader import bytes_read
from tests.fault_proxy import FaultProxy
from tests.fixtures_ray import free_port

SHARD_BYTES = 120_000  # several shards of the tiny FSDP fixture: more tasks than worker CPUs
OPTIONS = OutputOptions(max_shard_size=SHARD_BYTES)


def _files(url: str) -> dict[str, bytes]:
    return {e.path: storage.read_bytes(storage.join(url, e.path)) for e in storage.list_files(url)
            if e.path != "stepmerge.json"}  # stepmerge.json records the source URL


def _tensor_bytes(safetensors: bytes) -> int:
    return len(safetensors) - 8 - int.from_bytes(safetensors[:8], "little")


@pytest.fixture(scope="module")
def local_merge(fsdp_runs, tmp_path_factory) -> dict[str, bytes]:
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    result = run_job(MergeJob(source, str(tmp_path_factory.mktemp("ray_local") / "out"), OPTIONS),
                     executor=LocalExecutor(1))
    files = _files(result.target_url)
    assert sum(f.endswith(".safetensors") for f in files) >= 4
    return files


def _on_s3(fsdp_runs, s3_bucket_url: str, name: str) -> str:
    remote = f"{s3_bucket_url}/{name}/actor"
    storage.copy_tree(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, remote)
    return remote


def test_shards_run_on_the_worker_nodes_each_reading_the_source_itself(fsdp_runs, local_merge, ray_local_cluster,
                                                                      s3_bucket_url, tmp_path):
    source = _on_s3(fsdp_runs, s3_bucket_url, "nodes")
    ray_local_cluster.wait_for_nodes()
    executor = RayExecutor(ray_local_cluster.address)
    before = bytes_read()
    result = run_job(MergeJob(source, str(tmp_path / "merged"), OPTIONS), executor=executor)
    coordinator_read = bytes_read() - before

    got = _files(result.target_url)
    assert got == local_merge
    shards = [f for f in local_merge if f.endswith(".safetensors")]
    workers = {node.node_id for node in ray_local_cluster.nodes.values()}
    assert len(executor.task_runs) == len(shards)
    assert {run.node_id for run in executor.task_runs} == workers  # both worker nodes, never the head
    runs = dict(zip(sorted(shards), executor.task_runs))  # tasks are in the order of the plan's shards
    for shard, run in runs.items():
        assert run.source_bytes >= _tensor_bytes(got[shard]) > 0, shard
    total = sum(_tensor_bytes(got[shard]) for shard in shards)
    assert coordinator_read < total / 4  # metadata (pickles, config, tokenizer): the weights it never read


def _shard_task_pids(sessions: set[int]) -> list[int]:
    """Ray workers of the test's cluster (``sessions``: never another cluster of the machine) running a
    shard task (Ray titles a worker ``ray::<task name>`` while it runs that task)."""
    pids = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) in sessions and "ray::stepmerge-shard" in " ".join(process.cmdline()):
                pids.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return pids


def _kill_node_mid_shard(cluster, victim: str, proxy: FaultProxy, killed: list[int], stop: threading.Event) -> None:
    """Hold the storage still once the first shard task runs (no task can finish from then on), wait until a
    shard task runs on node ``victim``, SIGKILL that node's whole process group, let the storage go."""
    node = cluster.nodes[victim]
    held = False
    try:
        while not stop.is_set():
            running = _shard_task_pids(cluster.sessions())
            if running and not held:
                proxy.hold()
                held = True
            if any(os.getsid(pid) == node.session for pid in running if psutil.pid_exists(pid)):
                os.killpg(node.session, signal.SIGKILL)
                killed.append(node.session)
                return
            time.sleep(0.01)
    except ProcessLookupError:
        pass
    finally:
        if held:
            proxy.release()


def test_a_worker_node_killed_mid_merge_leaves_the_local_bytes(fsdp_runs, local_merge, ray_local_cluster,
                                                               s3_bucket_url, s3_env, tmp_path, monkeypatch):
    source = _on_s3(fsdp_runs, s3_bucket_url, "killed-node")
    ray_local_cluster.wait_for_nodes()
    killed: list[int] = []
    stop = threading.Event()
    try:
        with FaultProxy(s3_env.port) as proxy:
            monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", proxy.url)
            monkeypatch.setenv("STEPMERGE_READ_AHEAD_BYTES", "0")  # travels to the workers: every read is a request
            storage.clear_filesystems()
            watcher = threading.Thread(target=_kill_node_mid_shard, args=(ray_local_cluster, "b", proxy, killed, stop))
            watcher.start()
            try:
                executor = RayExecutor(ray_local_cluster.address)
                result = run_job(MergeJob(source, str(tmp_path / "merged"), OPTIONS), executor=executor)
            finally:
                stop.set()
                watcher.join()
        assert killed, "no shard task was caught running on node b"
        assert _files(result.target_url) == local_merge
        assert not [p for p in (tmp_path / "merged").rglob("*") if ".tmp-" in p.name]
        assert {run.node_id for run in executor.task_runs} <= {ray_local_cluster.nodes["a"].node_id,
                                                               ray_local_cluster.nodes["b"].node_id}
    finally:
        storage.clear_filesystems()
        ray_local_cluster.kill_node("b")  # waits until the head lists it dead (a no-op kill if it was)
        ray_local_cluster.start_nodes(("b",), wait=False)  # back for later tests; none needs it at once


def _non_ray_port(s3_env) -> str:
    return f"127.0.0.1:{s3_env.port}"  # SeaweedFS: answers, but HTTP/1.1, not Ray's gRPC


@pytest.mark.parametrize("address, error", [
    ("dead", "RayClusterUnreachable"),
    ("not_ray", "RayClusterUnreachable"),
    ("not-an-address", "InvalidOption"),
    ("127.0.0.1:99999", "InvalidOption"),
    ("http://127.0.0.1:8265", "InvalidOption"),
])
def test_a_wrong_ray_address_is_a_named_error_at_once(address, error, fsdp_runs, tmp_path, capsys, request,
                                                      monkeypatch):
    """Refused by the address check, before Ray is asked to connect (Ray's own connect retries for minutes)."""
    from merge_engine.cli import main
    from merge_engine.output.executors import ray as ray_executor

    if address == "dead":
        address = f"127.0.0.1:{free_port()}"  # nothing listens there any more
    elif address == "not_ray":
        address = _non_ray_port(request.getfixturevalue("s3_env"))
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    asked: list[str] = []
    monkeypatch.setattr(ray_executor, "import_ray", lambda: asked.append(address) or pytest.fail("Ray was asked"))
    code = main(["merge", "--local_dir", source, "--target_dir", str(tmp_path / "out"), "--ray-address", address])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and asked == [], (code, asked)
    assert len(err) == 1 and err[0].startswith(f"stepmerge: error: {error}: ") and address in err[0], err
    assert not (tmp_path / "out").exists()


WARMED_MERGE = """
import json, sys
import ray
from merge_engine.commands.merge import MergeJob
from merge_engine.output.executors import executor_at
from merge_engine.output.jobs import OutputOptions, run_job

executor = executor_at("ray:" + sys.argv[1])
connecting = executor._connecting is not None
result = run_job(MergeJob(sys.argv[2], sys.argv[3], OutputOptions(max_shard_size=int(sys.argv[4]))), executor=executor)
print(json.dumps({"connecting": connecting, "warm": [[w.node_id, w.pid] for w in ray.get(executor.warm_ups)],
                  "tasks": [[run.node_id, run.pid] for run in executor.task_runs]}))
"""


CLI_MERGE = """
import json, runpy, sys
from merge_engine.output.executors.ray import RayExecutor

report, sys.argv = sys.argv[1], ["stepmerge"] + sys.argv[2:]
start = RayExecutor.start_connecting
def recorded(self):
    open(report, "w").write(json.dumps({"torch_imported": "torch" in sys.modules}))
    start(self)
RayExecutor.start_connecting = recorded
runpy.run_module("merge_engine", run_name="__main__")
"""


def test_the_cli_connects_to_ray_before_it_imports_torch(fsdp_runs, local_merge, ray_local_cluster, tmp_path):
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    root = Path(__file__).resolve().parents[4]
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", CLI_MERGE, str(report), "merge", "--local_dir", source,
                           "--target_dir", str(tmp_path / "out"), "--max-shard-size", str(SHARD_BYTES),
                           "--ray-address", ray_local_cluster.address], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(report.read_text()) == {"torch_imported": False}
    assert _files(str(tmp_path / "out")) == local_merge


def test_a_bad_checkpoint_fails_before_the_cli_asks_the_cluster(ray_local_cluster, tmp_path):
    """The CLI checks the checkpoint (no torch) before it connects: an empty folder is a named error and no
    Ray connection is begun."""
    root = Path(__file__).resolve().parents[4]
    report = tmp_path / "report.json"
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-c", CLI_MERGE, str(report), "merge", "--local_dir", str(tmp_path / "empty"),
                           "--target_dir", str(tmp_path / "out"), "--ray-address", ray_local_cluster.address],
                          cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)},
                          timeout=600)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.strip().startswith("stepmerge: error: IncompleteCheckpoint: ")
    assert not report.exists() and not (tmp_path / "out").exists()


def test_workers_start_while_the_coordinator_prepares_and_run_the_tasks(fsdp_runs, local_merge, ray_local_cluster,
                                                                         tmp_path):
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", WARMED_MERGE, ray_local_cluster.address, source,
                           str(tmp_path / "out"), str(SHARD_BYTES)], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["connecting"]  # begun by executor_at, before the job was checked
    warm = dict(seen["warm"])  # node -> the worker started there ahead (one per CPU: nodes a and b, 1 CPU each)
    assert len(warm) == len(seen["warm"]) >= 1  # node b may still be coming back from the test that killed it
    on_warm_nodes = [pid for node, pid in seen["tasks"] if node in warm]
    assert on_warm_nodes and set(on_warm_nodes) <= set(warm.values())  # the tasks ran in the workers started ahead
    assert _files(str(tmp_path / "out")) == local_merge


@pytest.mark.parametrize(("node_cpus", "tasks", "threads"), [
    ([2.0], 1, 2),  # a one-shard merge on a 2-CPU node: both CPUs on its byte ranges
    ([0.0, 1.0, 1.0], 1, 1),  # the session's cluster: no node has 2 CPUs
    ([0.0, 1.0, 1.0], 5, 1),
    ([8.0, 8.0], 3, 5),  # 16 CPUs for 3 tasks
    ([8.0, 8.0], 1, 8),  # never more than one node has
    ([4.0], 9, 1),  # more tasks than CPUs: one each, queued
    ([], 1, 1),
])
def test_each_task_takes_its_share_of_the_cluster_cpus(node_cpus, tasks, threads):
    assert threads_per_task(node_cpus, tasks) == threads
