"""merge_step with ``ray_address``: the shard jobs run as Prefect task runs on the session's Ray cluster.

- the release is byte-identical to the one merged by threads in the merge task's process, and the
  Prefect API shows a ``write-shards`` subflow with one Completed ``write-shard`` task run per shard,
  named after the step and the shard's file;
- every release's manifest holds the shard jobs' sha256 for its weight files (carried by the merge
  task's record) and each equals a fresh sha256 of the published file (with and without Ray);
- a named error met by one shard task (a worker that plans another shard than the coordinator, the
  sign of a checkpoint changed mid-merge) fails the shard runs with that error, not a wrapper.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentTaskRunId

from flows.merge_step import merge_step
from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.release.folders import MANIFEST, MARKER, release_url
from merge_engine.release.manifest import read_manifest
from tests.fixtures_pipeline import copy_steps, flow_run_id, task_runs

SHARD_SIZE = "300KB"  # several shards of the template's tiny Qwen2


def _params(run_root: str, tmp_path: Path, name: str, **extra) -> dict:
    return dict(run_root=run_root, step=1, release_root=str(tmp_path / name / "releases"),
                staging_root=str(tmp_path / name / "staging"), max_shard_size=SHARD_SIZE, validate_forward=False,
                **extra)


def _published(release: str) -> dict[str, bytes]:
    return {e.path: storage.read_bytes(storage.join(release, e.path)) for e in storage.list_files(release)}


def _fresh_sha256_matches_manifest(release: str, files: dict[str, bytes]) -> None:
    manifest = {f.path: f.sha256 for f in read_manifest(release).files}
    assert set(manifest) == set(files) - {MANIFEST, MARKER}
    for path, data in files.items():
        if path not in (MANIFEST, MARKER):
            assert manifest[path] == hashlib.sha256(data).hexdigest(), path


def _shard_runs(parent_flow_run: str) -> tuple[list, list]:
    """The subflow runs started from ``parent_flow_run``'s tasks (write-shards), and their task runs."""
    parents = [run.id for runs in task_runs(parent_flow_run).values() for run in runs]
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(any_=parents)))
        shard_tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id for run in subflows]))) if subflows else []
    return subflows, shard_tasks


def test_merge_step_on_ray_publishes_the_local_release_with_one_task_run_per_shard(
        prefect, template_run, ray_cluster, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])

    local = merge_step(**_params(run_root, tmp_path, "local", workers=2), return_state=True)
    on_ray = merge_step(**_params(run_root, tmp_path, "ray", ray_address=ray_cluster), return_state=True)
    assert local.result().status == on_ray.result().status == "published"

    local_files = _published(release_url(str(tmp_path / "local" / "releases"), "actor", 1))
    ray_release = release_url(str(tmp_path / "ray" / "releases"), "actor", 1)
    ray_files = _published(ray_release)
    shards = sorted(p for p in ray_files if p.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors.index.json" in ray_files
    content = set(local_files) - {MANIFEST, MARKER}
    assert set(ray_files) - {MANIFEST, MARKER} == content
    assert all(ray_files[path] == local_files[path] for path in content)  # byte for byte

    for release, files in ((ray_release, ray_files),
                           (release_url(str(tmp_path / "local" / "releases"), "actor", 1), local_files)):
        _fresh_sha256_matches_manifest(release, files)

    subflows, shard_tasks = _shard_runs(flow_run_id(on_ray))
    assert [run.name for run in subflows] == ["write-shards global_step_1/actor"]
    assert subflows[0].state.name == "Completed"
    assert sorted(run.name for run in shard_tasks) == [f"global_step_1/actor: {shard}" for shard in shards]
    assert all(run.state.name == "Completed" and run.run_count == 1 for run in shard_tasks)
    assert _shard_runs(flow_run_id(local)) == ([], [])  # threads in the merge task: no subflow


def test_a_named_error_in_one_shard_task_fails_the_shard_runs_with_it(prefect, template_run, ray_cluster, tmp_path):
    from dataclasses import replace

    from merge_engine.commands.merge import MergeJob
    from merge_engine.output.executors.remote import UnitTask
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.plan.merge_plan import parse_size
    from tasks.shard_runs import PrefectRayExecutor

    run_root = tmp_path / "run"
    copy_steps(template_run, str(run_root), [1])
    target = str(tmp_path / "out")
    job = MergeJob(str(run_root / "global_step_1" / "actor"), target,
                   OutputOptions(max_shard_size=parse_size(SHARD_SIZE)))
    job.fingerprint()
    prepared = job.prepare()
    try:
        shards = prepared.outputs[0].plan.shards
    finally:
        prepared.close()
    tasks = [UnitTask(job, f"test:{job.fingerprint()}", 0, index, target, 1 << 20,
                      (shard.filename, shard.size, tuple(shard.tensors))) for index, shard in enumerate(shards)]
    tasks[1] = replace(tasks[1], planned=(tasks[1].file, tasks[1].planned[1] + 8, tasks[1].planned[2]))
    with pytest.raises(CorruptShard, match="checkpoint changed during the merge"):
        PrefectRayExecutor(ray_cluster, "global_step_1/actor").run_all(tasks, lambda record: None)
    assert not any(p.name == shards[1].filename for p in Path(target).glob("*"))
