"""The push-to-hub task against the local Hub (`tests.hub_server`) and the suite's Prefect server:

- the token comes from a Prefect Secret block named by the flow (or ``HF_TOKEN``) and is in no result or log line;
- the revision is the template filled with the step (``-adapter`` for an adapter release) and the moving ref follows;
- only a transient fault is retried (the Hub out of reach); a refusal (no token, a missing block) runs once.
"""

from __future__ import annotations

import logging

import pytest
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from merge_engine.errors import HubPushRefused
from tasks.hub import HubTarget, push_release
from tests.clock import until
from tests.hub_server import WRITE_TOKEN, hub  # noqa: F401 - the fixture
from tests.merge_engine.release.test_hub_push import release_of


def _run_count(state) -> int:
    """The task run's attempts as the server records them, once it has the run's final state (the client sends
    task run states as events: the server's record follows, it does not lead; on a loaded machine the run may not
    be recorded at all yet, a 404)."""
    with get_client(sync_client=True) as client:
        def final():
            try:
                run = client.read_task_run(state.state_details.task_run_id)
            except ObjectNotFound:  # the server has not taken the run's first event yet
                return False
            return run.state is not None and run.state.type == state.type

        until(final, f"recorded by the server as {state.type.value}")
        return client.read_task_run(state.state_details.task_run_id).run_count


def test_the_token_of_a_secret_block_pushes_and_is_never_shown(prefect, hub, tmp_path, caplog):
    Secret(value=WRITE_TOKEN).save("hub-task-token", overwrite=True)
    hub.create_repo("tester/run")
    target = HubTarget(repo="tester/run", moving_ref="latest", token_secret="hub-task-token", endpoint=hub.url)
    with caplog.at_level(logging.INFO):
        pushed = push_release(release_of(tmp_path, 3), target, 3, "actor", adapter=True)
    assert (pushed.revision, pushed.moved_refs, hub.commits) == ("step-3-adapter", ("latest-adapter",), 1)
    assert "tester/run@step-3-adapter: pushed" in caplog.text
    assert WRITE_TOKEN not in repr(pushed) and WRITE_TOKEN not in caplog.text


@pytest.mark.parametrize("case, runs", [("hub down", 3), ("no token", 1), ("no block", 1)])
def test_only_a_hub_out_of_reach_is_retried(prefect, hub, tmp_path, monkeypatch, case, runs):
    hub.create_repo("tester/run")
    if case == "hub down":
        monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    target = HubTarget(repo="tester/run", token_secret="no-such-hub-token" if case == "no block" else None,
                       endpoint="http://127.0.0.1:9" if case == "hub down" else hub.url)
    state = push_release.with_options(retries=2, retry_delay_seconds=0)(
        release_of(tmp_path, 1), target, 1, "actor", return_state=True)
    assert state.is_failed() and _run_count(state) == runs
    error = state.result(raise_on_failure=False)
    expected = {"hub down": "cannot reach the Hub", "no token": "no Hugging Face token",
                "no block": "no Prefect Secret block named 'no-such-hub-token'"}[case]
    assert isinstance(error, HubPushRefused) and expected in str(error) and "\n" not in str(error)
    assert hub.commits == 0
