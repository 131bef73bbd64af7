"""One deployment run per step: the watcher, deployed, submits merge-step/gpu runs with idempotency keys.

- the same step submitted twice (two watcher ticks while a merge is pending) is one flow run;
- a run that completed although the step is unpublished (its release was deleted since) is followed
  by exactly one new run, under a key derived from the old run (the same for every watcher);
- a run that failed is not resubmitted on every tick;
- merge_new_steps from a deployment submits one run per new step, and a second tick adds none.
"""

from __future__ import annotations

from types import SimpleNamespace

from prefect.client.orchestration import get_client
from prefect.states import Completed, Failed

import flows.merge_new_steps as watcher
from flows.params import MergeStepParams, WatchParams
from flows.submission import submit_step_run
from tests.fixtures_pipeline import copy_steps


def _set_state(run_id: str, state) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, state, force=True)


def _params(step: int) -> dict:
    return {"params": MergeStepParams(run_root="s3://submit-bucket/run", step=step).model_dump(mode="json")}


def test_same_step_twice_is_one_run_and_finished_runs_are_handled_once(deployed):
    key = "s3://submit-bucket/run:actor:5"
    first = submit_step_run("merge-step/gpu", _params(5), key)
    second = submit_step_run("merge-step/gpu", _params(5), key)
    assert second.flow_run_id == first.flow_run_id and first.state == "Scheduled"
    assert first.idempotency_key == key and not first.resubmitted

    _set_state(first.flow_run_id, Completed())  # ... and then its release was deleted
    rebuilt = submit_step_run("merge-step/gpu", _params(5), key)
    assert rebuilt.flow_run_id != first.flow_run_id and rebuilt.resubmitted
    assert rebuilt.idempotency_key == f"{key}:after:{first.flow_run_id}"
    assert submit_step_run("merge-step/gpu", _params(5), key).flow_run_id == rebuilt.flow_run_id

    _set_state(rebuilt.flow_run_id, Failed(message="CorruptShard"))
    failed = submit_step_run("merge-step/gpu", _params(5), key)
    assert failed.flow_run_id == rebuilt.flow_run_id and failed.failed_earlier


def test_the_deployed_watcher_submits_one_run_per_new_step(deployed, prefect, template_run, tmp_path, monkeypatch):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    monkeypatch.setattr(watcher, "deployment", SimpleNamespace(id="the-watch-deployment"))  # as if deployed
    params = WatchParams(run_root=run_root)

    first = watcher.merge_new_steps(params)
    assert [(a.step, a.action) for a in first.actions] == [(1, "submitted"), (2, "submitted")]
    second = watcher.merge_new_steps(params)  # next tick: the merges have not run yet
    assert [a.detail for a in second.actions] == [a.detail for a in first.actions]  # the same flow runs
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(first.actions[0].detail.split()[2])
    assert run.idempotency_key == f"{run_root}:actor:1"
    assert MergeStepParams(**run.parameters["params"]).step == 1
