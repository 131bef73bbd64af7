"""Flow parameters: pydantic models the Prefect UI renders as forms with defaults, checked before any work.

The parameter schema Prefect builds for each flow (what the UI's form is made from) has the
fields with their defaults and constraints; bad values (negative step, a scheme off the list, a
``..`` path) are refused when the run is created, before a task runs.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import AdapterParams, MergeStepParams, RunLocation, WatchParams
from flows.release_adapter import release_adapter
from flows.url_checks import checked_url
from tests.fixtures_pipeline import flow_run_id, task_runs


def _definition(flow, name: str) -> dict:
    schema = flow.parameters.model_dump()
    assert schema["required"] == ["params"]
    return schema["definitions"][name]


def test_the_ui_form_has_every_option_with_its_default_and_constraints():
    form = _definition(merge_step, "MergeStepParams")
    props = form["properties"]
    assert set(form["required"]) == {"run_root", "step"}
    assert props["step"]["minimum"] == 0
    assert props["role"]["default"] == "actor" and set(props["role"]["enum"]) == {"actor", "critic", ""}
    assert props["max_shard_size"]["default"] == "5GB"
    assert props["validate_forward"]["default"] is True and props["overwrite"]["default"] is False
    assert all(p.get("description") for p in props.values())
    watch = _definition(merge_new_steps, "WatchParams")["properties"]
    assert watch["merge_deployment"]["default"] == "merge-step/gpu" and watch["roles"]["default"] == ["actor", ""]
    assert "include_base" in _definition(release_adapter, "AdapterParams")["properties"]


@pytest.mark.parametrize("bad", [
    {"step": -1},
    {"run_root": "ftp://host/run"},
    {"run_root": "s3://bucket/run/../../other"},
    {"run_root": "s3://bucket/run/%2e%2e/other"},
    {"run_root": "s3://"},
    {"run_root": "s3://bucket/run\x00"},
    {"role": "ref"},
    {"max_shard_size": "lots"},
    {"release_root": "http://evil/x"},
    {"unknown_option": 1},
])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValidationError):
        MergeStepParams(**{"run_root": "s3://bucket/run", "step": 3, **bad})


def test_good_parameters_and_derived_settings():
    params = MergeStepParams(run_root="s3://bucket/run/", step=3, dtype="bfloat16", max_shard_size="500MiB")
    assert params.run_root == "s3://bucket/run"
    assert params.release_root_url == "s3://bucket/run/releases"
    assert params.key == "s3://bucket/run:actor:3"
    assert params.merge_settings().max_shard_size == 500 * 1024**2
    assert params.merge_settings().dtype == "bfloat16"
    assert MergeStepParams(run_root="/data/run", step=0, role="").release_root_url == "/data/run/releases"
    watch = WatchParams(run_root="gs://bucket/run", release_root="gs://bucket/releases")
    assert watch.release_root_url == "gs://bucket/releases"


def test_url_allow_list_is_configurable():
    assert checked_url("s3://b/run", schemes=("s3",), allow_local_paths=False) == "s3://b/run"
    with pytest.raises(ValueError):
        checked_url("/local/run", schemes=("s3",), allow_local_paths=False)
    with pytest.raises(ValueError):
        checked_url("gs://b/run", schemes=("s3",))


def test_a_bad_parameter_fails_the_run_before_any_task(prefect):
    state = merge_step(params={"run_root": "s3://bucket/run", "step": -5}, return_state=True)
    assert state.is_failed()
    message = str(state.message)
    assert "step" in message and "greater than or equal to 0" in message  # names the field and the rule
    assert task_runs(flow_run_id(state)) == {}  # not one task ran


def test_lora_alpha_reaches_the_merge_and_its_cache_key():
    """The trained model of a LoRA run that recorded no alpha needs it as much as the adapter does."""
    params = MergeStepParams(run_root="s3://bucket/run", step=3, lora_alpha=16)
    assert params.merge_settings().lora_alpha == 16
    assert params.merge_settings().to_options().lora_alpha == 16
    assert params.adapter_settings().lora_alpha == 16
    assert params.merge_settings() != MergeStepParams(run_root="s3://bucket/run", step=3).merge_settings()


@pytest.mark.parametrize("model", [MergeStepParams, WatchParams, AdapterParams])
def test_every_flow_locates_its_run_the_same_way(model):
    """One definition of run_root, release_root and staging_root (`RunLocation`) for the three flows."""
    assert issubclass(model, RunLocation)
    extra = {"step": 1} if model is not WatchParams else {}
    params = model(run_root="s3://bucket/run/", **extra)
    assert params.run_root == "s3://bucket/run" and params.release_root_url == "s3://bucket/run/releases"
    assert model(run_root="gs://b/run", release_root="gs://b/rel/", **extra).release_root_url == "gs://b/rel"
    for bad in ("ftp://host/run", "s3://bucket/../x", "s3://"):
        with pytest.raises(ValidationError):
            model(run_root=bad, **extra)
    with pytest.raises(ValidationError):
        model(run_root="s3://bucket/run", staging_root="s3://bucket/%2e%2e/x", **extra)
