"""One key per step, ``{run_root}:{role}:{step}``, built by one function whatever the route.

The watcher (`flows.merge_new_steps`), a form or trigger run (`MergeStepParams`), a run's outcome
(`StepOutcome`), the webhook (`CheckpointSaved`) and `stepmerge notify` (the event's resource id)
must agree on the key of a step however its run root was spelled (a trailing slash, or several),
or one step gets two runs.
"""

from __future__ import annotations

import pytest

from deployments.webhook import CheckpointSaved
from flows.events import RESOURCE_PREFIX, checkpoint_saved_event
from flows.params import MergeStepParams
from flows.stages import StepOutcome
from flows.step_keys import normalized_run_root, resubmission_key, step_key

SPELLINGS = ["s3://bucket/run", "s3://bucket/run/", "s3://bucket/run//"]
EXPECTED = "s3://bucket/run:actor:7"


@pytest.mark.parametrize("run_root", SPELLINGS)
def test_every_route_builds_the_same_key(run_root):
    assert step_key(run_root, "actor", 7) == EXPECTED
    assert MergeStepParams(run_root=run_root, step=7).key == EXPECTED
    assert StepOutcome(run_root=run_root, step=7, role="actor", status="published").key == EXPECTED
    assert CheckpointSaved(run_root=run_root, step=7).key == EXPECTED
    event = checkpoint_saved_event(run_root, 7)
    assert event["resource"]["prefect.resource.id"] == RESOURCE_PREFIX + EXPECTED
    assert event["payload"]["run_root"] == "s3://bucket/run"


def test_sft_runs_have_an_empty_role_and_steps_are_integers():
    assert step_key("gs://b/sft/", "", 3) == "gs://b/sft::3"
    assert step_key("/data/run/", "critic", "12") == "/data/run:critic:12"
    assert normalized_run_root("/") == "/" and normalized_run_root("s3://b/run/") == "s3://b/run"


def test_resubmission_keys_derive_from_the_step_key():
    assert resubmission_key(EXPECTED, "1234") == f"{EXPECTED}:after:1234"
