"""Retries: transient storage faults only, with exponential backoff and jitter; named errors fail once.

The verdicts are checked on real exception objects (as s3fs/botocore raise them), then on real
Prefect task runs: a task with the stage tasks' retry options retries a connection reset until it
succeeds, and fails a `CorruptShard` on its first and only attempt.
"""

from __future__ import annotations

import time

import pytest
from prefect import flow, task
from prefect.states import Failed

from merge_engine.errors import CorruptShard, IncompleteCheckpoint, ValidationFailed, WorldSizeMismatch
from merge_engine.release.publish import ReleaseBusy
from tasks.retry import RETRY_BASE_DELAY_S, RETRY_OPTIONS, failure_exception, transient_fault
from tests.fixtures_pipeline import flow_run_id, task_runs


def _botocore_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as exc:
        return exc


TRANSIENT = {
    "connection reset": ConnectionResetError(104, "Connection reset by peer"),
    "timeout": TimeoutError("read timed out"),
    "S3 SlowDown (503)": _botocore_error("SlowDown", 503),
    "s3fs OSError from a 503": _raised_from(_botocore_error("ServiceUnavailable", 503), OSError("service unavailable")),
    "another publisher holds the release": ReleaseBusy("busy"),
}
PERMANENT = {
    "corrupt shard": CorruptShard("not a zip archive", "s3://b/run/global_step_1/actor/model_world_size_2_rank_0.pt"),
    "incomplete checkpoint": IncompleteCheckpoint("rank 1 missing", "s3://b/run/global_step_1/actor"),
    "world size mismatch": WorldSizeMismatch("2 != 4", "s3://b/run"),
    "failed validation": ValidationFailed("expected_keys", "/tmp/staging"),
    "corrupt shard raised from a reset": _raised_from(ConnectionResetError(), CorruptShard("bad header", "x")),
    "missing file": FileNotFoundError("s3://b/run/x"),
    "access denied": _botocore_error("AccessDenied", 403),
    "a bug": ValueError("unexpected"),
}


@pytest.mark.parametrize("name", TRANSIENT)
def test_transient_storage_faults_are_retried(name):
    assert transient_fault(None, None, Failed(data=TRANSIENT[name])) is True


@pytest.mark.parametrize("name", PERMANENT)
def test_bad_input_and_unknown_errors_are_not_retried(name):
    assert transient_fault(None, None, Failed(data=PERMANENT[name])) is False


def test_a_state_without_an_exception_is_not_retried():
    assert not isinstance(failure_exception(Failed(message="no data")), (OSError, TimeoutError))
    assert transient_fault(None, None, Failed(message="no data")) is False


@pytest.mark.parametrize("name", ["discover_steps", "find_published", "check_step",
                                  "merge_model", "extract_adapter", "validate_output", "validate_adapter",
                                  "publish_release"])
def test_every_stage_task_retries_transient_faults_only_with_exponential_backoff_and_jitter(name):
    """Delays base * 2**n (the tests set the base to 0.2 s; production 10 s), Prefect's jitter on top."""
    import tasks

    stage = getattr(tasks, name)
    assert stage.retries == 3
    assert stage.retry_delay_seconds == [RETRY_BASE_DELAY_S * 2**n for n in range(3)]
    assert stage.retry_jitter_factor > 0
    assert stage.retry_condition_fn is transient_fault


def test_a_transient_fault_is_retried_until_it_succeeds(prefect):
    attempts: list[float] = []

    @task(**RETRY_OPTIONS)
    def flaky_listing() -> str:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise ConnectionResetError(104, "Connection reset by peer")
        return "listed"

    @flow
    def run():
        return flaky_listing(return_state=True)

    state = run(return_state=True)
    assert state.is_completed()
    assert state.result().result() == "listed"
    assert len(attempts) == 3
    (task_run,) = task_runs(flow_run_id(state))["flaky_listing"]
    assert task_run.run_count == 3 and task_run.state.name == "Completed"


def test_a_named_error_fails_once_without_retries(prefect):
    attempts: list[int] = []

    @task(**RETRY_OPTIONS)
    def read_shard() -> None:
        attempts.append(1)
        raise CorruptShard("not a zip archive", "model_world_size_2_rank_0.pt")

    @flow
    def run():
        return read_shard(return_state=True)

    state = run(return_state=True)
    task_state = state.result(raise_on_failure=False)
    assert task_state.is_failed()
    assert isinstance(task_state.result(raise_on_failure=False), CorruptShard)
    assert len(attempts) == 1
    (task_run,) = task_runs(flow_run_id(state))["read_shard"]
    assert task_run.run_count == 1 and task_run.state.name == "Failed"
