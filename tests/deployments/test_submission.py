"""One deployment run per step: the watcher, deployed, submits merge-step/gpu runs with idempotency keys.

Keys: the first run of a step is keyed ``{run_root}:{role}:{step}``; every later run
``<that key>:after:<the previous run's id>`` — derived from the run before it, so every submitter
that looks at the same finished run derives the same key and the next run is created once.

- the same step submitted twice (two watcher ticks while a merge is pending) is one flow run;
- a run that completed although the step is unpublished (its release was deleted since) is followed
  by exactly one new run; one that completed after the watcher listed the releases is not (the listing
  could not show its release);
- a FAILED run is resubmitted when the step's listing changed since it was submitted (the
  checkpoint was rewritten, or was still being written), and otherwise a bounded number of times
  with a growing pause (outages longer than the task retries; a fixed bug); then it is given up
  and reported, and the watcher run itself does not fail for it on every tick;
- a failed run started by the webhook (same key, no listing) does not block the watcher;
- one step whose submission fails does not stop the others (the tick reports it and fails at the end);
- merge_new_steps from a deployment submits one run per new step, and a second tick adds none.
"""

from __future__ import annotations

import datetime as dt
import uuid
from types import SimpleNamespace

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey
from prefect.states import Cancelled, Completed, Crashed, Failed, Running, Scheduled

import flows.merge_new_steps as watcher
import flows.submission as submission
from flows.params import MergeStepParams, WatchParams
from flows.step_keys import step_key
from flows.submission import decide, listing_tag, submit_step_run
from tests.fixtures_pipeline import copy_steps

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.timezone.utc)


def _set_state(run_id: str, state) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, state, force=True)


def _params(step: int) -> dict:
    return MergeStepParams(run_root="s3://submit-bucket/run", step=step).flow_parameters()


def _fake(state, listing: str | None = None, ended: dt.datetime | None = None):
    tags = [listing_tag(listing)] if listing else []
    return SimpleNamespace(id=uuid.uuid4(), state=state, tags=tags, end_time=ended)


class TestDecide:
    """The policy alone, on runs as the API returns them (state, tags, end time)."""

    def test_a_run_not_finished_is_the_steps_run(self):
        for state in (Scheduled(), Running()):
            assert decide([_fake(state, "a")], "a", NOW, rebuild_completed=True).action == "use"

    def test_completed_runs_are_rebuilt_for_the_watcher_but_answer_a_webhook(self):
        chain = [_fake(Completed(), "a", NOW)]
        assert decide(chain, "a", NOW, rebuild_completed=True).action == "resubmit"
        assert decide(chain, None, NOW, rebuild_completed=False).action == "use"

    def test_a_run_completed_after_the_watcher_listed_the_releases_is_not_rebuilt(self):
        """The watcher's listing was taken before the run published: it cannot tell a deleted release from one it
        did not see yet, so the run stands and the next tick looks again (before: a second, needless run)."""
        chain = [_fake(Completed(), "a", NOW)]
        listed_before = NOW - dt.timedelta(seconds=5)
        assert decide(chain, "a", NOW, rebuild_completed=True, listed_at=listed_before).action == "use"
        listed_after = NOW + dt.timedelta(seconds=submission.CLOCK_MARGIN_S + 1)
        assert decide(chain, "a", NOW, rebuild_completed=True, listed_at=listed_after).action == "resubmit"

    def test_a_failed_run_of_another_listing_is_resubmitted_at_once(self):
        for state in (Failed(), Crashed(), Cancelled()):
            assert decide([_fake(state, "old", NOW)], "new", NOW, rebuild_completed=True).action == "resubmit"

    def test_a_failed_run_of_the_same_listing_waits_then_is_resubmitted_then_given_up(self, monkeypatch):
        monkeypatch.setattr(submission, "RESUBMIT_BASE_DELAY_S", 600.0)
        first = [_fake(Failed(), "a", NOW)]
        waiting = decide(first, "a", NOW + dt.timedelta(seconds=10), rebuild_completed=True)
        assert waiting.action == "wait" and waiting.retry_at == NOW + dt.timedelta(seconds=600)
        assert decide(first, "a", NOW + dt.timedelta(seconds=601), rebuild_completed=True).action == "resubmit"
        second = first + [_fake(Failed(), "a", NOW)]  # the pause doubles
        assert decide(second, "a", NOW + dt.timedelta(seconds=601), rebuild_completed=True).action == "wait"
        assert decide(second, "a", NOW + dt.timedelta(seconds=1201), rebuild_completed=True).action == "resubmit"
        given_up = second + [_fake(Crashed(), "a", NOW)]
        verdict = decide(given_up, "a", NOW + dt.timedelta(days=30), rebuild_completed=True)
        assert verdict.action == "give_up" and "3" in verdict.reason
        assert decide(given_up, "b", NOW, rebuild_completed=True).action == "resubmit"  # rewritten: new input

    def test_a_cancelled_run_stays_cancelled_unless_the_step_changes(self):
        assert decide([_fake(Cancelled(), "a", NOW)], "a", NOW + dt.timedelta(days=1), True).action == "give_up"

    def test_runs_without_a_listing_count_as_the_same_listing(self):
        """Webhook, trigger and UI runs carry no listing: their failures count toward the same budget."""
        chain = [_fake(Failed(), None, NOW)]
        assert decide(chain, "a", NOW, rebuild_completed=True).action == "wait"


def test_same_step_twice_is_one_run_and_finished_runs_are_handled_once(deployed):
    key = "s3://submit-bucket/run:actor:5"
    first = submit_step_run("merge-step/gpu", _params(5), key, listing="listing-a")
    second = submit_step_run("merge-step/gpu", _params(5), key, listing="listing-a")
    assert second.flow_run_id == first.flow_run_id and first.state == "Scheduled"
    assert first.idempotency_key == key and not first.resubmitted

    _set_state(first.flow_run_id, Completed())  # ... and then its release was deleted
    rebuilt = submit_step_run("merge-step/gpu", _params(5), key, listing="listing-a")
    assert rebuilt.flow_run_id != first.flow_run_id and rebuilt.resubmitted
    assert rebuilt.idempotency_key == f"{key}:after:{first.flow_run_id}"
    assert submit_step_run("merge-step/gpu", _params(5), key, listing="listing-a").flow_run_id == rebuilt.flow_run_id

    _set_state(rebuilt.flow_run_id, Failed(message="CorruptShard"))
    failed = submit_step_run("merge-step/gpu", _params(5), key, listing="listing-a")
    assert failed.flow_run_id == rebuilt.flow_run_id and failed.failed_earlier and failed.action == "waiting"


def test_a_failed_run_is_resubmitted_once_when_the_step_was_rewritten(deployed):
    key = "s3://submit-bucket/run:actor:6"
    first = submit_step_run("merge-step/gpu", _params(6), key, listing="being-written")
    _set_state(first.flow_run_id, Failed(message="CorruptShard: truncated"))
    assert submit_step_run("merge-step/gpu", _params(6), key, listing="being-written").action == "waiting"
    again = submit_step_run("merge-step/gpu", _params(6), key, listing="written")
    assert again.resubmitted and again.idempotency_key == f"{key}:after:{first.flow_run_id}"
    other_watcher = submit_step_run("merge-step/gpu", _params(6), key, listing="written")
    assert other_watcher.flow_run_id == again.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(again.flow_run_id)
    assert listing_tag("written") in run.tags


def test_failed_runs_are_resubmitted_a_bounded_number_of_times(deployed, monkeypatch):
    monkeypatch.setattr(submission, "RESUBMIT_BASE_DELAY_S", 0.0)
    key = "s3://submit-bucket/run:actor:7"
    seen = []
    for _ in range(submission.MAX_RUNS_PER_LISTING):
        run = submit_step_run("merge-step/gpu", _params(7), key, listing="same")
        assert run.flow_run_id not in seen
        seen.append(run.flow_run_id)
        _set_state(run.flow_run_id, Failed(message="S3 outage"))
    last = submit_step_run("merge-step/gpu", _params(7), key, listing="same")
    assert last.action == "gave up" and last.flow_run_id == seen[-1]
    assert "rerun it from the UI" in last.detail


def test_a_failed_webhook_run_does_not_block_the_watcher(deployed, monkeypatch):
    key = step_key("s3://submit-bucket/run", "actor", 8)
    with get_client(sync_client=True) as client:  # what the webhook receiver does: the base key, no listing
        hooked = client.create_flow_run_from_deployment(deployed["merge-step/gpu"].id, parameters=_params(8),
                                                       idempotency_key=key)
    _set_state(str(hooked.id), Failed(message="ValidationFailed"))
    assert submit_step_run("merge-step/gpu", _params(8), key, listing="x").action == "waiting"
    monkeypatch.setattr(submission, "RESUBMIT_BASE_DELAY_S", 0.0)  # ... the pause is over
    resubmitted = submit_step_run("merge-step/gpu", _params(8), key, listing="x")
    assert resubmitted.resubmitted and resubmitted.idempotency_key == f"{key}:after:{hooked.id}"


def _runs_with_key(key: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            idempotency_key=FlowRunFilterIdempotencyKey(any_=[key])))


def test_one_step_that_cannot_be_submitted_does_not_stop_the_others(deployed, prefect, template_run, tmp_path,
                                                                    monkeypatch):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    monkeypatch.setattr(watcher, "deployment", SimpleNamespace(id="the-watch-deployment"))
    real = watcher.submit_step_run

    def failing_for_step_1(deployment, parameters, key, **kwargs):
        if key.endswith(":1"):
            raise RuntimeError("the API refused the run")
        return real(deployment, parameters, key, **kwargs)

    monkeypatch.setattr(watcher, "submit_step_run", failing_for_step_1)
    state = watcher.merge_new_steps(**WatchParams(run_root=run_root).flow_parameters(), return_state=True)
    assert state.is_failed() and "the API refused the run" in str(state.result(raise_on_failure=False))
    assert len(_runs_with_key(step_key(run_root, "actor", 2))) == 1  # step 2 was submitted all the same


def test_the_deployed_watcher_submits_one_run_per_new_step(deployed, prefect, template_run, tmp_path, monkeypatch):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    monkeypatch.setattr(watcher, "deployment", SimpleNamespace(id="the-watch-deployment"))  # as if deployed
    params = WatchParams(run_root=run_root)

    first = watcher.merge_new_steps(**params.flow_parameters())
    assert [(a.step, a.action) for a in first.actions] == [(1, "submitted"), (2, "submitted")]
    second = watcher.merge_new_steps(**params.flow_parameters())  # next tick: the merges have not run yet
    assert [a.detail for a in second.actions] == [a.detail for a in first.actions]  # the same flow runs
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(first.actions[0].detail.split()[2])
    assert run.idempotency_key == f"{run_root}:actor:1"
    assert MergeStepParams(**run.parameters).step == 1


def test_a_watcher_tick_does_not_fail_for_runs_that_failed_before(deployed, prefect, template_run, tmp_path,
                                                                 monkeypatch):
    """A run that failed earlier is reported (waiting to be resubmitted, or given up): not a failure of
    every later tick."""
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    monkeypatch.setattr(watcher, "deployment", SimpleNamespace(id="the-watch-deployment"))
    params = WatchParams(run_root=run_root)
    (submitted,) = watcher.merge_new_steps(**params.flow_parameters()).actions
    _set_state(submitted.detail.split()[2], Failed(message="CorruptShard"))
    state = watcher.merge_new_steps(**params.flow_parameters(), return_state=True)
    assert state.is_completed()
    (action,) = state.result().actions
    assert action.action == "failed earlier" and "resubmitted after" in action.detail
