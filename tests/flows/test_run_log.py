"""An expected user error in a flow run is one line in the run's log: the named error, with no traceback and no
"unexpected exception" (Prefect's words for a crash), read from the suite's real Prefect server. That holds for an
error raised in the flow's own code and for one raised inside a task (``task_raised``: the merge task's
InvalidConfig, which its task runs logged three more times before, each naming it)."""

import pytest

from flows.merge_step import merge_step
from tests.fixtures_pipeline import copy_steps, flow_run_id, rank_file


def run_log(state) -> list[str]:
    """Every log line of the flow run and its task runs, as the server holds them (what the UI shows)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id(state)])))
    return [log.message for log in logs]


def as_a_worker_runs(parameters: dict):
    """Run merge_step as Prefect's engine does in a worker's process: a flow run made first, then run with the
    run's logger as the engine's error logger (which logs an exception the run raises on). Returns its state."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.logging.loggers import flow_run_logger

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(merge_step, parameters=parameters)
    with pytest.raises(Exception) as raised:
        run_flow(merge_step, flow_run=flow_run, parameters=parameters, error_logger=flow_run_logger(flow_run=flow_run))
    with get_client(sync_client=True) as client:
        return raised.value, client.read_flow_run(flow_run.id).state


@pytest.mark.parametrize("case", ["step_not_found", "not_ready", "raised", "task_raised"])
def test_an_expected_error_is_one_line_in_the_run_log(prefect, template_run, tmp_path, case):
    """``raised``: run as a worker runs it, the engine raises the error on and logs "Engine execution exited with
    unexpected exception" unless it is dropped."""
    from merge_engine.errors import StepNotFound

    run_root = str(tmp_path / "run")
    if case == "step_not_found":
        copy_steps(template_run, run_root, [1])
        state, error = merge_step(run_root=run_root, step=40, return_state=True), "StepNotFound"
    elif case == "raised":
        copy_steps(template_run, run_root, [1])
        exc, state = as_a_worker_runs({"run_root": run_root, "step": 40})
        assert isinstance(exc, StepNotFound), exc
        error = "StepNotFound"
    elif case == "task_raised":  # the merge task finds no config.json where hf_model_path points
        copy_steps(template_run, run_root, [1])
        state = merge_step(run_root=run_root, step=1, hf_model_path=str(tmp_path / "no-config"), return_state=True)
        error = "InvalidConfig"
    else:  # step 1 still being written, and no watcher deployed to come back for it
        copy_steps(template_run, run_root, [1], omit=[rank_file(1, 1)])
        state, error = merge_step(run_root=run_root, step=1, return_state=True), "IncompleteCheckpoint"
    assert state.is_failed()
    log = run_log(state)
    print("\n".join(log))
    assert [line for line in log if error in line] and len([line for line in log if error in line]) == 1, log
    assert not any("Traceback" in line or "unexpected exception" in line.lower() for line in log), log
