"""Shard jobs, run by every executor, give the same bytes as one worker; failures leave nothing behind.

Specification (issue 10, "Tests"):
- `--workers 2` (threads here) and a Ray cluster (2 CPUs, started once per session) each write output
  byte-identical to the one-worker merge, for an FSDP checkpoint, a Megatron TP x PP checkpoint and a
  LoRA checkpoint (fused), from a local folder and from ``s3://`` (SeaweedFS) to ``s3://``;
- ``stepmerge split``: each Megatron rank file (legacy) or DCP data file (dist) is one file job; threads
  and Ray write the same files, byte for byte, as one worker, with the same checksums;
- the checksums the shard jobs return are the sha256 of the files at the target;
- a source fault met mid-merge by one job (a rank file truncated after planning) fails the whole merge
  with the named error, the other jobs stop, and the target is absent;
- a Ray worker killed in the middle of a shard: Ray runs the task again, the output is still
  byte-identical, and no half-written shard or temp file is left at the target; the same under the
  Prefect runner (`tasks.shard_runs.PrefectRayExecutor`: the shard's task run is run again).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import threading
import time
import psutil
import pytest

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.output.executors.ray import RayExecutor
from merge_engine.output.jobs import OutputOptions, run_job
from merge_engine.commands.merge import MergeJob
from merge_engine.commands.split import SplitJob
from synthetic_runs.megatron import REFERENCE_HF_DIR
from tests.clock import until
from tests.fault_proxy import FaultProxy, Network

SHARD_BYTES = 120_000  # several shards from the tiny fixture models


def _sources(fsdp_runs, megatron_runs) -> dict[str, tuple[str, OutputOptions]]:
    megatron = megatron_runs["llama_tp2_pp2_te_legacy"]
    return {
        "fsdp": (fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, OutputOptions(max_shard_size=SHARD_BYTES)),
        "megatron_tp2_pp2": (str(megatron.step_dir / "actor"),
                             OutputOptions(backend="megatron", max_shard_size=SHARD_BYTES)),
        "lora_fused": (fsdp_runs["lora_fsdp2_qwen2_r2"].latest.checkpoint_dir,
                       OutputOptions(max_shard_size=SHARD_BYTES, dtype="bfloat16")),
    }


def _files(url: str) -> dict[str, bytes]:
    return {entry.path: storage.read_bytes(storage.join(url, entry.path)) for entry in storage.list_files(url)}


def _merge(source: str, target: str, options: OutputOptions, executor, **kwargs):
    return run_job(MergeJob(source, target, options), executor=executor, **kwargs)


@pytest.fixture(scope="module")
def one_worker(fsdp_runs, megatron_runs, tmp_path_factory):
    """Each source merged by one worker: the bytes every other executor must give."""
    root = tmp_path_factory.mktemp("one_worker")
    out = {}
    for name, (source, options) in _sources(fsdp_runs, megatron_runs).items():
        result = _merge(source, str(root / name), options, LocalExecutor(1))
        assert len([f for f, _ in result.files if f.endswith(".safetensors")]) >= 3, name
        out[name] = (result, _files(result.target_url))
    return out


@pytest.mark.parametrize("name", ["fsdp", "megatron_tp2_pp2", "lora_fused"])
def test_two_workers_give_the_same_bytes(name, fsdp_runs, megatron_runs, one_worker, tmp_path):
    source, options = _sources(fsdp_runs, megatron_runs)[name]
    result = _merge(source, str(tmp_path / "out"), options, LocalExecutor(2))
    assert _files(result.target_url) == one_worker[name][1]
    assert result.checksums == one_worker[name][0].checksums


@pytest.mark.parametrize("name", ["fsdp", "megatron_tp2_pp2", "lora_fused"])
def test_ray_gives_the_same_bytes(name, fsdp_runs, megatron_runs, one_worker, ray_cluster, tmp_path):
    source, options = _sources(fsdp_runs, megatron_runs)[name]
    result = _merge(source, str(tmp_path / "out"), options, RayExecutor(ray_cluster))
    assert _files(result.target_url) == one_worker[name][1]


def test_checksums_are_the_sha256_of_the_written_files(one_worker):
    for name, (result, files) in one_worker.items():
        weights = {f for f in files if f.endswith(".safetensors") or f.endswith(".index.json")}
        assert dict(result.checksums).keys() == weights, name
        for file, digest in result.checksums:
            assert hashlib.sha256(files[file]).hexdigest() == digest, (name, file)


@pytest.mark.parametrize("executor", ["workers2", "ray"])
def test_s3_to_s3_gives_the_same_bytes(executor, fsdp_runs, megatron_runs, one_worker, s3_bucket_url, request):
    """FSDP, Megatron TP x PP and LoRA fuse, each read from ``s3://`` and written to ``s3://``."""
    runner = LocalExecutor(2) if executor == "workers2" else RayExecutor(request.getfixturevalue("ray_cluster"))
    for name, (source, options) in _sources(fsdp_runs, megatron_runs).items():
        remote_source = f"{s3_bucket_url}/{name}/run/actor"
        storage.copy_tree(source, remote_source)
        result = _merge(remote_source, f"{s3_bucket_url}/{name}/merged", options, runner)
        got = _files(result.target_url)
        expected = one_worker[name][1]
        assert got.keys() == expected.keys(), name
        for file, data in expected.items():
            if file != "stepmerge.json":  # it records the source URL
                assert got[file] == data, (name, file)
        assert result.checksums == one_worker[name][0].checksums, name


def _truncate_a_rank_file(source: str):
    def on_plan(plan) -> None:
        rank_file = sorted(f for f in os.listdir(source) if f.startswith("model_world_size"))[-1]
        path = os.path.join(source, rank_file)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return on_plan


@pytest.mark.parametrize("executor", ["workers2", "ray"])
def test_a_source_fault_mid_merge_fails_the_whole_merge(executor, fsdp_runs, tmp_path, request):
    """The rank file is cut after the plan was made: a shard job meets the end of the file (a Ray worker,
    which re-reads the archive's index, finds it unreadable), the merge fails with a named error naming
    the file, the other jobs have stopped when it is raised (no unit thread left; no Ray worker still runs
    a shard task once they are all back to idle), and neither the target nor a temp folder is left."""
    source = str(tmp_path / "actor")
    shutil.copytree(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, source)
    runner = LocalExecutor(2) if executor == "workers2" else RayExecutor(request.getfixturevalue("ray_cluster"))
    target = tmp_path / "merged"
    with pytest.raises((IncompleteCheckpoint, CorruptShard)) as info:
        _merge(source, str(target), OutputOptions(max_shard_size=SHARD_BYTES), runner,
               on_plan=_truncate_a_rank_file(source))
    assert "model_world_size" in str(info.value)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["actor"]
    if executor == "workers2":  # the unit threads are gone when the error is raised
        assert not [t.name for t in threading.enumerate() if t.name.startswith("stepmerge-unit")]
    else:  # every shard task has ended (its worker is back to ray::IDLE, or gone)
        cluster = request.getfixturevalue("ray_local_cluster")
        until(lambda: not [p for p in psutil.pids() if _runs_task(p, "stepmerge-shard", cluster.sessions())],
              "every shard task ended")
    # none of them wrote a shard (re-creating a folder) after the failure
    assert [p.name for p in tmp_path.iterdir()] == ["actor"] and not target.exists()


def _runs_task(pid: int, task_name: str, sessions: set[int]) -> bool:
    """Whether ``pid`` is a worker of the test's Ray cluster (one of its nodes' process sessions ``sessions``:
    never another cluster of the machine) running a task named ``task_name`` (Ray titles a worker
    ``ray::<task name>`` while it runs that task, ``ray::IDLE`` between tasks)."""
    try:
        return os.getsid(pid) in sessions and f"ray::{task_name}" in " ".join(psutil.Process(pid).cmdline())
    except (OSError, psutil.Error):
        return False


_SHARD_TEMP = re.compile(r"^\.model-.*\.tmp-(\d+)-[0-9a-f]+$")  # storage's temp name: the writer's pid


def _kill_a_worker_held_mid_shard(target_parent, killed: list[int], stop: threading.Event, task_name: str,
                                  sessions: set[int], proxy: FaultProxy) -> None:
    """Once a shard's temp file appears (writing has begun), hold the network: a worker writing a shard
    then waits for its next source byte and cannot finish it (or, if it had read them all, finishes and
    the next shard task waits at its first read). SIGKILL a worker that owns a temp file (its pid is in
    the temp name) while it runs ``task_name``; then let the network flow again, at loopback speed."""
    held = False
    try:
        while not stop.is_set():
            temps = [p for p in target_parent.rglob(".model-*.tmp-*") if _SHARD_TEMP.match(p.name)]
            if temps and not held:
                proxy.hold()
                held = True
                continue  # look again: the temp files still there now belong to held writers
            for temp in temps:
                pid = int(_SHARD_TEMP.match(temp.name).group(1))
                if _runs_task(pid, task_name, sessions):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.01)
    finally:
        if held:
            proxy.set_network(None, open_connections=True)
            proxy.release()


def _merge_with_a_worker_killed(executor, task_name: str, sessions: set[int], fsdp_runs, s3_bucket_url, s3_env, tmp_path,
                                monkeypatch):
    """Merge the FSDP fixture from ``s3://`` through a slow network (one request at a time, 300 KB/s per
    connection, no read-ahead: every tensor read is a request), SIGKILL one Ray worker held in the middle
    of a shard (`_kill_a_worker_held_mid_shard`); the rest of the merge runs at loopback speed."""
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    options = OutputOptions(max_shard_size=SHARD_BYTES)
    remote_source = f"{s3_bucket_url}/slow/actor"
    storage.copy_tree(source, remote_source)
    killed: list[int] = []
    stop = threading.Event()
    with FaultProxy(s3_env.port, network=Network(latency=0.01, bandwidth=300_000)) as proxy:
        monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", proxy.url)
        monkeypatch.setenv("STEPMERGE_REQUESTS_IN_FLIGHT", "1")
        monkeypatch.setenv("STEPMERGE_READ_AHEAD_BYTES", "0")  # travels to the workers (`storage_env`)
        storage.clear_filesystems()
        watcher = threading.Thread(target=_kill_a_worker_held_mid_shard,
                                   args=(tmp_path, killed, stop, task_name, sessions, proxy))
        watcher.start()
        try:
            result = _merge(remote_source, str(tmp_path / "merged"), options, executor)
        finally:
            stop.set()
            watcher.join()
    assert killed, "no shard task was caught mid-write"
    return result


def _same_as_one_worker(result, one_worker, tmp_path) -> None:
    got = _files(result.target_url)
    expected = one_worker["fsdp"][1]
    assert {f: d for f, d in got.items() if f != "stepmerge.json"} == \
        {f: d for f, d in expected.items() if f != "stepmerge.json"}
    assert result.checksums == one_worker["fsdp"][0].checksums
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "prefect-results") == ["merged"]
    assert not [p for p in (tmp_path / "merged").rglob("*") if ".tmp-" in p.name]


def test_a_ray_worker_killed_mid_shard_is_retried(fsdp_runs, one_worker, ray_cluster, ray_local_cluster,
                                                 s3_bucket_url, s3_env, tmp_path, monkeypatch):
    """One shard task's worker is killed mid-write; Ray runs it again; the output is byte-identical and
    no temp file is left."""
    result = _merge_with_a_worker_killed(RayExecutor(ray_cluster), "stepmerge-shard", ray_local_cluster.sessions(), fsdp_runs,
                                         s3_bucket_url, s3_env, tmp_path, monkeypatch)
    _same_as_one_worker(result, one_worker, tmp_path)


def test_a_ray_worker_killed_mid_shard_under_prefect_is_retried(prefect, fsdp_runs, one_worker, ray_cluster,
                                                                ray_local_cluster, s3_bucket_url, s3_env, tmp_path,
                                                                monkeypatch):
    """The same under Prefect's Ray runner: the killed ``write-shard`` task run is run again by Ray (same
    task run), the merge completes byte-identical, no temp file is left, and the API shows every shard's
    task run Completed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    from tasks.shard_runs import PrefectRayExecutor

    label = f"killed-{tmp_path.name}"
    result = _merge_with_a_worker_killed(PrefectRayExecutor(ray_cluster, label), "write-shard", ray_local_cluster.sessions(),
                                         fsdp_runs, s3_bucket_url, s3_env, tmp_path, monkeypatch)
    _same_as_one_worker(result, one_worker, tmp_path)
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"write-shards {label}"])))
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in subflows])))
    shards = sorted(f for f in dict(result.checksums) if f.endswith(".safetensors"))
    assert [r.state.name for r in subflows] == ["Completed"]
    assert sorted(r.name for r in runs) == [f"{label}: {shard}" for shard in shards]
    assert all(r.state.name == "Completed" for r in runs)


def test_the_command_line_runs_shard_jobs_where_it_is_told(fsdp_runs, one_worker, ray_cluster, tmp_path, capsys,
                                                           monkeypatch):
    """``--workers 2`` and ``--ray-address`` give the one-worker bytes; ``--workers 0`` is refused before anything."""
    from merge_engine.cli import main

    # --requests-in-flight sets both for the process: restored after the test
    monkeypatch.setattr(storage.tuning, "REQUESTS_IN_FLIGHT", storage.tuning.REQUESTS_IN_FLIGHT)
    monkeypatch.setenv("STEPMERGE_REQUESTS_IN_FLIGHT", str(storage.tuning.REQUESTS_IN_FLIGHT))

    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    common = ["merge", "--local_dir", source, "--max-shard-size", str(SHARD_BYTES), "--requests-in-flight", "8"]
    assert main([*common, "--target_dir", str(tmp_path / "threads"), "--workers", "2"]) == 0
    assert main([*common, "--target_dir", str(tmp_path / "ray"), "--ray-address", ray_cluster]) == 0
    for name in ("threads", "ray"):
        assert _files(str(tmp_path / name)) == one_worker["fsdp"][1], name
    with pytest.raises(SystemExit) as info:
        main([*common, "--target_dir", str(tmp_path / "none"), "--workers", "0"])
    assert info.value.code == 2 and "at least 1" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


# split: a Llama reference model (4 layers) -> TP 2 x PP 2 legacy rank files (4 file jobs), and dist (one
# DCP data file per layer + one for the rest: 5 file jobs)
SPLITS = {"legacy_tp2_pp2": OutputOptions(tp=2, pp=2), "dist": OutputOptions(format="dist", dtype="bfloat16")}


def _split_source(megatron_runs) -> str:
    return str(megatron_runs["llama_tp1_pp1_legacy"].reference_dir / REFERENCE_HF_DIR)


@pytest.fixture(scope="module")
def one_worker_splits(megatron_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_worker_splits")
    out = {}
    for name, options in SPLITS.items():
        result = run_job(SplitJob(_split_source(megatron_runs), str(root / name), options), executor=LocalExecutor(1))
        out[name] = (result, _files(result.target_url))
    return out


@pytest.mark.parametrize("executor", ["workers2", "ray"])
def test_split_file_jobs_give_the_same_bytes(executor, megatron_runs, one_worker_splits, tmp_path, request):
    """Each rank file (legacy) or DCP data file (dist) is one job: threads and Ray write every file byte
    for byte as one worker does; each job's checksum is the sha256 of its file."""
    runner = LocalExecutor(2) if executor == "workers2" else RayExecutor(request.getfixturevalue("ray_cluster"))
    for name, options in SPLITS.items():
        result = run_job(SplitJob(_split_source(megatron_runs), str(tmp_path / name), options), executor=runner)
        expected_result, expected = one_worker_splits[name]
        got = _files(result.target_url)
        assert got == expected, name
        jobs = [f for f in got if f.endswith(("model.pt", ".distcp"))]
        assert len(jobs) == (4 if name == "legacy_tp2_pp2" else 5), (name, sorted(got))
        checksums = dict(result.checksums)
        assert checksums == dict(expected_result.checksums)
        assert set(jobs) <= set(checksums)
        for file, digest in checksums.items():
            assert hashlib.sha256(got[file]).hexdigest() == digest, (name, file)
