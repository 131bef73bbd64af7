"""SIGINT and SIGTERM stop a merge cleanly; a rerun clears what a killed run left (issue 17, points 2 and 8).

Specification, with the real command line in a subprocess, a real SeaweedFS server and a real FSDP
checkpoint whose two large shards are S3 multipart uploads (written through a slow network, so the
signal always lands mid-upload: each test waits for that state, never for a time):
- Ctrl-C, pressed again and again on ``--workers 2`` to an ``s3://`` target: every shard job stops,
  its upload is aborted, the target is cleaned up whole (later Ctrl-Cs do not cut that short), the
  command says "interrupted" last and exits 130; nothing is left under the target (no object, no
  multipart upload); the same command run again succeeds without ``--overwrite``, with the bytes
  of an uninterrupted merge (point 2);
- SIGTERM during an ``s3://`` upload: the same, exit 143 (point 8);
- SIGKILL (nothing can clean up): the marker and multipart uploads stay; the same command run again
  recognises them as its own debris, aborts its stale uploads under the target, rebuilds without
  ``--overwrite`` and leaves other uploads of the bucket alone, even one whose key merely starts
  with the target's name (point 8: "no later run aborts");
- a local target: SIGINT / SIGTERM leave no stray file (no temp folder, no owner record, no target);
- ``--ray-address``: SIGTERM cancels every Ray shard task and waits for it; nothing is left under the target.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from merge_engine import storage
from merge_engine.cli import main
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.output.jobs import OutputOptions, run_job
from merge_engine.commands.merge import MergeJob
from merge_engine.plan.merge_plan import parse_size
from synthetic_runs import FsdpSpec, ModelSpec, write_fsdp_step
from tests.fault_proxy import FaultProxy, Network
from tests.fixtures_storage import fresh_bucket_name
from tests.servers import applied_env

# embed_tokens and lm_head: 9000 x 512 fp32 = 18.4 MB each, one shard each (> one 16 MiB upload part:
# multipart uploads); the layer between them is a 6 MB shard
SPEC = FsdpSpec(model=ModelSpec(vocab_size=9000, hidden_size=512, intermediate_size=512, num_layers=1),
                world_size=1, strategy="single", save_contents=("model",))
MAX_SHARD = "20MB"
SLOW = Network(bandwidth=16_000_000)  # bytes/s per connection and direction: a part takes a second


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    """The checkpoint, and the files of its uninterrupted merge (the bytes every rerun must give)."""
    root = tmp_path_factory.mktemp("interrupts")
    source = write_fsdp_step(root / "global_step_1", SPEC).checkpoint_dir
    result = run_job(MergeJob(source, str(root / "reference"), OutputOptions(max_shard_size=parse_size(MAX_SHARD))),
                     executor=LocalExecutor(1))
    assert sum(f.endswith(".safetensors") for f, _ in result.files) == 3
    return source, _files(result.target_url)


def _files(url: str) -> dict[str, bytes]:
    return {e.path: storage.read_bytes(storage.join(url, e.path)) for e in storage.list_files(url)
            if e.path != "stepmerge.json"}  # it records the target URL


def _command(source: str, target: str) -> list[str]:
    return ["merge", "--local_dir", source, "--target_dir", target, "--workers", "2", "--max-shard-size", MAX_SHARD]


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "merge_engine", *argv], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_until(state: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    """Poll ``state`` until it holds; the merge ending first fails the test."""
    while not state():
        if process.poll() is not None:
            pytest.fail(f"the merge ended (exit {process.returncode}) before {what}: {process.stderr.read()}")
        time.sleep(0.02)


def _interrupt(process: subprocess.Popen, signum: int, *, again_and_again: bool = False) -> str:
    """Send ``signum`` (and, like an impatient user, again on every poll until the process is gone); its stderr."""
    process.send_signal(signum)
    while again_and_again and process.poll() is None:
        time.sleep(0.05)
        if process.poll() is None:
            process.send_signal(signum)
    return process.communicate(timeout=600)[1]


class Bucket:
    """What the server holds under a prefix of one bucket: objects and multipart uploads in progress."""

    def __init__(self, server, url: str) -> None:
        self.client = server.client()
        self.name = url.removeprefix("s3://")

    def objects(self, prefix: str) -> list[str]:
        return [o["Key"] for o in self.client.list_objects_v2(Bucket=self.name, Prefix=prefix).get("Contents", [])]

    def uploads(self, prefix: str = "") -> list[str]:
        found = self.client.list_multipart_uploads(Bucket=self.name, Prefix=prefix).get("Uploads", [])
        return sorted(u["Key"] for u in found)


def _slow_env(s3_env, proxy: FaultProxy) -> dict[str, str]:
    return {**s3_env.env(), "STEPMERGE_S3_ENDPOINT": proxy.url, "AWS_ENDPOINT_URL": proxy.url}


def _interrupted_mid_upload(big_run, s3_env, s3_bucket_url, signum: int, again_and_again: bool = False):
    """The merge to ``<bucket>/out`` through a slow network, ``signum`` sent once a multipart upload of a
    shard is in progress under the target; (exit code, stderr, the bucket)."""
    source, _ = big_run
    bucket = Bucket(s3_env, s3_bucket_url)
    with FaultProxy(s3_env.port, network=SLOW) as proxy:
        process = _start(_command(source, f"{s3_bucket_url}/out"), _slow_env(s3_env, proxy))
        _wait_until(lambda: bucket.uploads("out/"), process, "a shard's multipart upload began")
        stderr = _interrupt(process, signum, again_and_again=again_and_again)
    return process.returncode, stderr, bucket


def _rerun_gives_the_uninterrupted_bytes(big_run, target: str) -> None:
    source, reference = big_run
    assert main(_command(source, target)) == 0  # the same command, no --overwrite
    assert _files(target) == reference


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_ctrl_c_again_and_again_on_two_workers_leaves_nothing_at_an_s3_target(big_run, s3_env, s3_bucket_url):
    """Point 2: the shard jobs stop, their uploads are aborted, the cleanup runs whole despite more
    Ctrl-Cs, "interrupted" is the last word, exit 130; nothing is left; the rerun rebuilds."""
    code, stderr, bucket = _interrupted_mid_upload(big_run, s3_env, s3_bucket_url, signal.SIGINT,
                                                   again_and_again=True)
    assert (code, _last_line(stderr).split(" after ")[0]) == (130, "stepmerge: interrupted (SIGINT)"), stderr
    assert "Traceback" not in stderr
    assert bucket.objects("out/") == [] and bucket.uploads() == []
    _rerun_gives_the_uninterrupted_bytes(big_run, f"{s3_bucket_url}/out")
    assert bucket.uploads() == []


def test_sigterm_during_an_s3_upload_aborts_it(big_run, s3_env, s3_bucket_url):
    """Point 8: SIGTERM is an interrupt too: the multipart upload in progress is aborted, nothing is
    left, exit 143; the rerun rebuilds."""
    code, stderr, bucket = _interrupted_mid_upload(big_run, s3_env, s3_bucket_url, signal.SIGTERM)
    assert (code, _last_line(stderr).split(" after ")[0]) == (143, "stepmerge: interrupted (SIGTERM)"), stderr
    assert bucket.objects("out/") == [] and bucket.uploads() == []
    _rerun_gives_the_uninterrupted_bytes(big_run, f"{s3_bucket_url}/out")
    assert bucket.uploads() == []


def test_a_rerun_after_a_kill_aborts_its_own_stale_uploads_and_no_one_elses(big_run, s3_env, s3_bucket_url):
    """Point 8: SIGKILL leaves the partial marker and a multipart upload in progress; the same command
    run again aborts that upload (stepmerge's: under the target, begun since the marker), rebuilds
    without --overwrite, and leaves the uploads of ``out2/`` and ``outside.bin`` (outside the target,
    though their keys start with its name) as they were."""
    bucket = Bucket(s3_env, s3_bucket_url)
    others = []
    for key in ("out2/model-00001-of-00003.safetensors", "outside.bin"):
        bucket.client.create_multipart_upload(Bucket=bucket.name, Key=key)
        others.append(key)
    code, _, _ = _interrupted_mid_upload(big_run, s3_env, s3_bucket_url, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert ".stepmerge-partial.json" in {key.rsplit("/", 1)[-1] for key in bucket.objects("out/")}
    assert [key for key in bucket.uploads() if key.startswith("out/")]  # the debris the rerun must clear
    _rerun_gives_the_uninterrupted_bytes(big_run, f"{s3_bucket_url}/out")
    assert bucket.uploads() == sorted(others)


@pytest.fixture(scope="module")
def remote_run(big_run, s3_server) -> str:
    """The checkpoint copied once to ``s3://`` (the local-target tests read it through a slow network)."""
    with applied_env(s3_server.env(), s3_server.unset_env()):
        remote = s3_server.make_bucket(fresh_bucket_name()) + "/run/actor"
        storage.copy_tree(big_run[0], remote)
    return remote


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_an_interrupted_merge_to_a_local_folder_leaves_no_stray_file(signum, big_run, remote_run, s3_env, tmp_path):
    """The source is read from ``s3://`` through a slow network; once a shard's temp file is being
    written, the signal (SIGINT again and again): exit 128 + signal, and the target's folder holds
    nothing (no target, no temp folder, no owner record); the rerun rebuilds."""
    remote = remote_run
    parent = tmp_path / "outputs"
    parent.mkdir()
    with FaultProxy(s3_env.port, network=SLOW) as proxy:
        process = _start(_command(remote, str(parent / "out")), _slow_env(s3_env, proxy))
        _wait_until(lambda: any(parent.rglob(".model-*.tmp-*")), process, "a shard's temp file appeared")
        stderr = _interrupt(process, signum, again_and_again=signum == signal.SIGINT)
    assert (process.returncode, _last_line(stderr).split(" after ")[0]) == \
        (128 + signum, f"stepmerge: interrupted ({signal.Signals(signum).name})"), stderr
    assert list(parent.iterdir()) == []
    assert main(_command(remote, str(parent / "out"))) == 0
    assert _files(str(parent / "out")) == big_run[1]


def test_sigterm_stops_ray_shard_tasks_and_their_uploads(big_run, ray_cluster, s3_env, s3_bucket_url):
    """``--ray-address``: SIGTERM to the coordinator cancels every shard task (a task whose upload is in
    progress aborts it) and waits for them before the cleanup: nothing is left under the target, exit 143."""
    source, _ = big_run
    bucket = Bucket(s3_env, s3_bucket_url)
    with FaultProxy(s3_env.port, network=SLOW) as proxy:
        process = _start([*_command(source, f"{s3_bucket_url}/out"), "--ray-address", ray_cluster],
                         _slow_env(s3_env, proxy))
        _wait_until(lambda: bucket.uploads("out/"), process, "a shard's multipart upload began")
        stderr = _interrupt(process, signal.SIGTERM)
    assert (process.returncode, _last_line(stderr).split(" after ")[0]) == \
        (143, "stepmerge: interrupted (SIGTERM)"), stderr
    assert bucket.objects("out/") == [] and bucket.uploads() == []
