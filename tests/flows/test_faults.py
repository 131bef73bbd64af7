"""Faults: transient ones (injected by a loopback TCP proxy in front of SeaweedFS) are retried to
success; a corrupted shard fails at once, without retries, and publishes nothing.

- an S3 outage longer than the engine's own per-request retries fails the first task attempt with
  a transient error; the task's retry condition says "retry", the outage ends, the retry succeeds;
- connection resets and a stall in the middle of downloads are ridden out (engine retries), the
  release is whole: the step's own weights bit for bit and its logits, judged from outside stepmerge
  (`tests.release_checks`), as after the outage;
- a rank file overwritten with garbage (same size, so the listing calls the step complete) fails
  the check task once (`CorruptShard`, run count 1): no release, no marker, and the watcher still
  merges the other steps and reports the failure.
"""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterParentFlowRunId

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step, summary_key
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.release.manifest import is_released
from merge_engine.release.folders import release_url
from merge_engine.release.verify import verify_folder
from tasks.retry import failure_exception, transient_fault
from tests.fault_proxy import Fault
from tests.fixtures_pipeline import copy_steps, flow_run_id, latest_artifacts, rank_file, task_runs
from tests.release_checks import assert_release_of_step


def _stage_tasks():
    import tasks

    return [getattr(tasks, name) for name in tasks.__all__]


def test_an_outage_longer_than_the_engine_retries_is_retried_by_the_task(
        prefect, template_run, s3_bucket_url, s3_fault_proxy, tmp_path, monkeypatch):
    run_root = f"{s3_bucket_url}/run"
    copy_steps(template_run, run_root, [1])
    # the engine gives up after one attempt (its backoff would otherwise ride out much of the outage)
    monkeypatch.setattr(storage.tuning, "TRANSIENT_ATTEMPTS", 1)
    verdicts = []

    def outage_ends_after_first_failure(task, task_run, state):
        verdict = transient_fault(task, task_run, state)
        verdicts.append((task.name, type(failure_exception(state)).__name__, verdict))
        s3_fault_proxy.set_fault(None)
        return verdict

    for stage in _stage_tasks():
        monkeypatch.setattr(stage, "retry_condition_fn", outage_ends_after_first_failure)
    s3_fault_proxy.set_fault(Fault.refuse(connections=10**6))  # every connection refused: S3 is down

    state = merge_step(**MergeStepParams(run_root=run_root, step=1, staging_root=str(tmp_path / "staging")).flow_parameters(),
                       return_state=True)
    assert state.is_completed()
    assert s3_fault_proxy.fired > 0
    assert len(verdicts) == 1 and verdicts[0][0] == "discover-step" and verdicts[0][2] is True
    (discover,) = task_runs(flow_run_id(state))["discover-step"]
    assert discover.run_count == 2 and discover.state.name == "Completed"
    assert verify_folder(release_url(f"{run_root}/releases", "actor", 1)).ok
    assert_release_of_step(release_url(f"{run_root}/releases", "actor", 1), template_run, 1)


@pytest.mark.parametrize("fault", [
    Fault.reset(after_bytes=100_000, connections=3),
    Fault.stall(seconds=3.0, after_bytes=50_000, connections=1),
], ids=["resets-mid-download", "stall-mid-download"])
def test_resets_and_stalls_during_the_merge_are_ridden_out(prefect, template_run, s3_bucket_url, s3_fault_proxy,
                                                           tmp_path, fault):
    run_root = f"{s3_bucket_url}/run"
    copy_steps(template_run, run_root, [2])
    s3_fault_proxy.set_fault(fault)
    outcome = merge_step(**MergeStepParams(run_root=run_root, step=2, staging_root=str(tmp_path / "staging")).flow_parameters())
    assert s3_fault_proxy.fired == fault.connections  # every fault really happened
    assert outcome.status == "published"
    assert verify_folder(outcome.releases[0].url).ok
    assert_release_of_step(outcome.releases[0].url, template_run, 2)  # no byte lost or doubled on a retry


def test_a_corrupted_shard_fails_without_retries_and_publishes_nothing(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    shard = tmp_path / "run" / rank_file(2, 1)
    shard.write_bytes(b"\x00garbage" * (shard.stat().st_size // 8) + b"\x00" * (shard.stat().st_size % 8))
    staging = tmp_path / "staging"

    state = merge_new_steps(**WatchParams(run_root=run_root, staging_root=str(staging)).flow_parameters(), return_state=True)
    assert state.is_failed()
    assert "1 step(s) failed" in str(state.result(raise_on_failure=False))
    releases = str(tmp_path / "run" / "releases")
    assert is_released(release_url(releases, "actor", 1))  # the good step was merged anyway
    assert_release_of_step(release_url(releases, "actor", 1), template_run, 1)
    assert not is_released(release_url(releases, "actor", 2))
    assert not storage.list_files(release_url(releases, "actor", 2))  # not one file, not even a claim
    assert not storage.list_files(str(staging))  # nothing was merged for it, nothing left behind

    with get_client(sync_client=True) as client:
        (failed_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id(state)]),
            name=FlowRunFilterName(any_=["run actor step 2"])))  # `flows.run_labels.step_run_name`
    assert failed_run.state.is_failed()
    runs = task_runs(str(failed_run.id))
    (check,) = runs["check-checkpoint"]
    assert check.state.name == "Failed" and check.run_count == 1  # CorruptShard: no retry
    assert not {"model-release", "merge-model", "publish-release"} & set(runs)

    params = MergeStepParams(run_root=run_root, step=2, staging_root=str(staging))
    direct = merge_step(**params.flow_parameters(), return_state=True)
    with pytest.raises(CorruptShard) as error:
        direct.result()
    assert str(shard) in str(error.value)  # the error names the file at fault
    (summary,) = latest_artifacts(summary_key(params))  # by key: a listing is one page
    assert "**Failed**: CorruptShard" in summary.data and str(shard) in summary.data
