"""The settings records a flow's stages get (`tasks.records`): written classes, filled from the flow's parameters.

- each record takes the flow parameters of its fields' names (``validate_forward`` fills ``forward``), the engine's
  values (a size in bytes), and keeps its defaults for the rest;
- a release records (its manifest, `FlowParams.recorded_options`) exactly the parameters that fill a recorded
  record: every record but the execution record (where the shard jobs run: the same bytes);
- what a build compares with a release's record (`BuildSettings.recorded_values`) is under the parameters' names,
  every field of the build's record (``base_model`` and ``include_base`` among them);
- a record survives pickle and cloudpickle (Prefect's task arguments, Ray's) as an equal record of its class.
"""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from flows.params import AdapterParams, MergeStepParams
from tasks.records import (
    SETTINGS_RECORDS, AdapterSettings, ExecutionSettings, MergeSettings, ValidationSettings, recorded_parameters,
)


def test_a_record_takes_the_parameters_of_its_fields_names():
    parameters = {"dtype": "bfloat16", "max_shard_size": "500MiB", "validate_forward": False, "workers": 2,
                  "include_base": False, "step": 3}
    merge = MergeSettings.from_parameters(parameters)
    assert (merge.dtype, merge.max_shard_size, merge.backend) == ("bfloat16", 500 * 1024**2, None)
    assert merge.model_fields_set == {"dtype", "max_shard_size"}
    assert AdapterSettings.from_parameters(parameters).include_base is False
    assert ValidationSettings.from_parameters(parameters).forward is False
    assert ExecutionSettings.from_parameters(parameters).workers == 2
    assert MergeSettings() == MergeSettings.from_parameters({})


def test_a_release_records_the_parameters_of_every_recorded_record():
    assert recorded_parameters() == {
        "backend", "dtype", "max_shard_size", "hf_model_path", "weights_format", "lora_alpha", "base_model",
        "base_model_id", "include_base", "validate_forward", "reference_url", "device"}
    assert set(MergeStepParams(run_root="s3://b/run", step=1).recorded_options()) == {
        "dtype", "max_shard_size", "hf_model_path", "weights_format", "lora_alpha", "base_model", "base_model_id",
        "include_base", "validate_forward", "reference_url"}
    assert set(AdapterParams(run_root="s3://b/run", step=1).recorded_options()) == {
        "include_base", "dtype", "validate_forward", "lora_alpha", "base_model", "base_model_id"}


def test_a_build_compares_every_field_under_the_parameters_names():
    settings = MergeStepParams(run_root="s3://b/run", step=1, base_model="s3://b/base", include_base=False).settings()
    assert settings["adapter"].recorded_values()["include_base"] is False
    assert settings["merge"].recorded_values()["base_model"] == "s3://b/base"
    assert ValidationSettings(forward=False).recorded_values()["validate_forward"] is False


@pytest.mark.parametrize("record", SETTINGS_RECORDS.values(), ids=list(SETTINGS_RECORDS))
def test_a_record_survives_pickle(record):
    value = record.from_parameters({"dtype": "float16", "workers": 2, "validate_forward": False})
    for dumps in (pickle.dumps, cloudpickle.dumps):
        again = pickle.loads(dumps(value))
        assert type(again) is record and again == value and again.model_fields_set == value.model_fields_set
