"""No green run that did nothing (issue 11, point 1): a run that cannot do its job is not Completed.

- a run root with no files (a typo: ``./runs/exp1n`` for ``exp1``) -> Failed, `RunRootNotFound` naming it
  (merge-step, release-adapter and the watcher alike);
- a step that is not under the run root -> Failed, `StepNotFound` listing the steps that are;
- a step not complete yet -> Completed ("not ready") ONLY when a watcher of that run root will come
  back for it, and the summary artifact names that watcher; with no watcher (none deployed, one for
  another run root, or one whose schedule is off) -> Failed, saying nobody would merge it later.
"""

from __future__ import annotations

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.release_adapter import release_adapter
from flows.watchers import watching_deployments
from tests.fixtures_pipeline import copy_steps, deploy_watcher, flow_run_id, rank_file, task_runs


def _summary(state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id(state)])))
    return "\n".join(a.data for a in artifacts if a.type == "markdown")


@pytest.mark.parametrize("flow", ["merge_step", "release_adapter", "merge_new_steps"])
def test_a_run_root_with_no_files_fails_the_run_naming_it(prefect, tmp_path, flow):
    typo = str(tmp_path / "runs" / "exp1n")
    call = {"merge_step": lambda: merge_step(run_root=typo, step=40, return_state=True),
            "release_adapter": lambda: release_adapter(run_root=typo, step=40, return_state=True),
            "merge_new_steps": lambda: merge_new_steps(run_root=typo, return_state=True)}[flow]
    state = call()
    assert state.is_failed()
    assert "RunRootNotFound" in state.message and typo in state.message and "typo" in state.message


def _flow_run(state):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id(state))


def _run_log(state) -> list[str]:
    """Every log line of the flow run and its task runs, as the server holds them (what the UI shows)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the logs still queued for the server
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id(state)])))
    return [log.message for log in logs]


def test_a_named_error_is_logged_without_a_traceback_and_a_bug_with_one(prefect, tmp_path):
    """Issue 20: bad input shows the named error in the run log, not 25 lines of engine frames."""
    typo = str(tmp_path / "runs" / "exp1n")
    state = merge_step(run_root=typo, step=40, return_state=True)
    log = _run_log(state)
    named = [line for line in log if "RunRootNotFound" in line]
    assert named and typo in named[0]
    assert not any("Traceback" in line for line in log), log
    # the control: an error that is not the user's (a bug) keeps its traceback
    from flows.run_log import UserErrorsWithoutTraceback
    import logging
    import sys

    for exc in (RuntimeError("bug"), __import__("merge_engine.errors").errors.RunRootNotFound("typo", "/x")):
        try:
            raise exc
        except Exception:
            record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
        UserErrorsWithoutTraceback().filter(record)
        assert (record.exc_info is None) == (not isinstance(exc, RuntimeError))


def test_a_step_that_is_not_there_fails_listing_the_steps_that_are(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    state = merge_step(run_root=run_root, step=40, return_state=True)
    assert state.is_failed()
    assert "StepNotFound" in state.message and "no checkpoint for step 40 (actor)" in state.message
    assert "steps there: 1 (actor), 2 (actor)" in state.message
    assert "**Failed**: StepNotFound" in _summary(state)


def _incomplete_step(template_run, tmp_path) -> str:
    """A run root whose step 1 lacks a rank file (its writer has not finished)."""
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1], omit=[rank_file(1, 1)])
    return run_root


def test_a_step_not_complete_yet_with_no_watcher_fails_saying_nobody_comes_back(prefect, template_run, tmp_path):
    run_root = _incomplete_step(template_run, tmp_path)
    deploy_watcher(str(tmp_path / "another-run"), f"other-{tmp_path.name}")  # watches something else
    deploy_watcher(run_root, f"paused-{tmp_path.name}", active=False)  # watches it, schedule off
    state = merge_step(run_root=run_root, step=1, return_state=True)
    assert state.is_failed()
    assert "IncompleteCheckpoint" in state.message and "is not complete yet" in state.message
    assert f"no watcher watches {run_root}" in state.message
    assert set(task_runs(flow_run_id(state))) == {"discover-step"}  # one listing of the step's folder, no more


def test_a_step_not_complete_yet_is_green_when_a_watcher_comes_back_and_says_which(prefect, template_run, tmp_path):
    run_root = _incomplete_step(template_run, tmp_path)
    watcher = deploy_watcher(run_root + "/", f"watch-{tmp_path.name}")  # its own spelling of the run root
    assert watching_deployments(run_root) == [watcher]
    state = merge_step(run_root=run_root, step=1, return_state=True)
    assert state.is_completed()
    # issue 20: a state an operator can filter (the badge says NotReady; the tag not-ready filters the list)
    assert state.name == "NotReady" and state.message.startswith("not ready yet: ")
    assert "not-ready" in _flow_run(state).tags
    outcome = state.result()
    assert outcome.status == "not_ready" and outcome.releases == []
    summary = _summary(state)
    assert "**Not ready yet**" in summary and f"the watcher {watcher} (on its schedule) merges it" in summary
