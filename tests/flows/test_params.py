"""Flow parameters: flat, typed, the required ones first; the UI's form is made from them, the server
checks them before a run exists (tests/deployments/test_prefect_yaml.py), the flow again before a task.

Each flow's ``def`` lists exactly its parameter model's fields, in order, with the same types and defaults (one
list, two spellings held together here), and every engine option a flow offers has the engine's name, type and
default (`OutputOptions`); the JSON schema carries the URL pattern, the size pattern, the
dtype spellings (the command line's) after "as stored", ``step >= 0``, and a description for every field. Every
choice is a visible control (no None toggle), and a refusal is worded, not a pattern (issue 20).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing

import pytest
from pydantic import TypeAdapter, ValidationError

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import (
    AS_STORED, RAY_ADDRESS_WORDS, SIZE_WORDS, URL_PATTERN, URL_WORDS, AdapterParams, MergeStepParams, RunLocation,
    WatchParams,
)
from flows.release_adapter import release_adapter
from flows.verify_releases import verify_releases
from flows.url_checks import checked_url
from merge_engine.option_values import DTYPE_SPELLINGS, SIZE_PATTERN, WEIGHTS_FORMATS, parse_size
from merge_engine.output.jobs import OutputOptions
from tasks.records import SETTINGS_RECORDS
from tests.fixtures_pipeline import flow_run_id, no_task_runs

FLOWS = [(merge_step, MergeStepParams), (merge_new_steps, WatchParams), (release_adapter, AdapterParams)]


def test_the_ui_form_has_every_option_with_its_default_and_constraints():
    schema = merge_step.parameters.model_dump()
    assert schema["required"] == ["step", "run_root"]
    props = schema["properties"]
    assert list(props)[:2] == ["step", "run_root"]  # the form lists the required values first
    assert props["step"]["minimum"] == 0
    assert props["run_root"]["allOf"][0]["if"]["not"]["pattern"] == URL_PATTERN  # behind words: see below
    assert props["max_shard_size"]["allOf"][0]["if"]["not"]["pattern"] == SIZE_PATTERN
    assert props["role"]["default"] == "actor" and set(props["role"]["enum"]) == {"actor", "critic", "policy", ""}
    assert props["max_shard_size"]["default"] == "5GB"
    assert props["validate_forward"]["default"] is True and props["overwrite"]["default"] is False
    assert all(p.get("description") for p in props.values())
    assert props["weights_format"]["default"] == "hub" and props["weights_format"]["enum"] == list(WEIGHTS_FORMATS)
    watch = merge_new_steps.parameters.model_dump()
    assert {k: v for k, v in watch["properties"]["weights_format"].items() if k != "position"} == \
        {k: v for k, v in props["weights_format"].items() if k != "position"}
    assert watch["required"] == ["run_root"]
    assert watch["properties"]["merge_deployment"]["default"] == "merge-step/gpu"
    assert watch["properties"]["roles"]["default"] == ["actor", ""]
    assert "include_base" in release_adapter.parameters.model_dump()["properties"]


@pytest.mark.parametrize("flow, model", FLOWS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_flow_signature_is_its_parameter_model(flow, model):
    """The ``def`` Prefect reads and the model the stages get: the same names in the same order, each with the
    same type (its form type and text) and the same default."""
    signature = inspect.signature(flow.fn).parameters
    assert list(signature) == list(model.model_fields)
    written = typing.get_type_hints(flow.fn, include_extras=True)
    declared = typing.get_type_hints(model, include_extras=True)
    for name, field in model.model_fields.items():
        parameter = signature[name]
        assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        assert written[name] == declared[name], name
        assert (parameter.default is inspect.Parameter.empty) == field.is_required(), name
        assert field.is_required() or parameter.default == field.default, name
    schema = flow.parameters.model_dump()
    assert list(schema["properties"]) == list(model.model_fields)
    assert schema["required"] == [name for name, field in model.model_fields.items() if field.is_required()]


# every engine option a flow offers, with a value the form admits other than its default
ENGINE_OPTIONS = {"dtype": "bf16", "max_shard_size": "500MiB", "weights_format": "transformers",
                  "hf_model_path": "s3://bucket/config", "lora_alpha": 16, "base_model": "s3://bucket/base",
                  "base_model_id": "org/base", "include_base": False, "overwrite": True, "workers": 3,
                  "ray_address": "auto"}


def engine_value(name: str, value: typing.Any) -> typing.Any:
    """A flow parameter's value as the settings record that carries it hands it to the engine (sizes in bytes)."""
    for record in SETTINGS_RECORDS.values():
        for field in record.model_fields:
            if record.parameter(field) == name:
                return getattr(record.from_parameters({name: value}), field)
    return value  # overwrite: passed to the engine as it is


@pytest.mark.parametrize("flow, model", FLOWS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_engine_option_a_flow_offers_is_the_engines(flow, model):
    """Name, type and default: the flow's default is the engine's default and a value the form admits is one of
    the engine's type, once the flow's value is the engine's (`engine_value`); the ``def`` agrees with the model
    (`test_each_flow_signature_is_its_parameter_model`)."""
    engine = {f.name: f for f in dataclasses.fields(OutputOptions)}
    hints = typing.get_type_hints(OutputOptions)
    offered = [name for name in model.model_fields if name in ENGINE_OPTIONS]
    assert offered and set(model.model_fields) & set(engine) <= set(offered)
    required = {"run_root": "s3://bucket/run", "step": 1}
    defaults = model(**{k: v for k, v in required.items() if k in model.model_fields})
    given = model(**{k: v for k, v in required.items() if k in model.model_fields},
                  **{name: ENGINE_OPTIONS[name] for name in offered})
    for name in offered:
        field = engine[name]
        default = engine_value(name, getattr(defaults, name))
        assert default == field.default, name
        value = engine_value(name, getattr(given, name))
        assert value != default, name
        kind = TypeAdapter(hints[field.name])
        assert kind.validate_python(default, strict=True) == default, name
        assert kind.validate_python(value, strict=True) == value, name


def test_the_form_and_the_command_line_accept_the_same_dtype_spellings_and_record_one():
    enum = merge_step.parameters.model_dump()["properties"]["dtype"]["enum"]
    assert enum == [AS_STORED, *DTYPE_SPELLINGS]
    for spelling, canonical in DTYPE_SPELLINGS.items():
        assert MergeStepParams(run_root="s3://b/run", step=1, dtype=spelling).recorded_options()["dtype"] == canonical


@pytest.mark.parametrize("spelling", list(DTYPE_SPELLINGS))
def test_the_form_and_the_command_line_give_the_engine_the_same_dtype_value(spelling):
    """Every spelling reaches the engine's options as one value: the same `Dtype` whether the form or ``--dtype``
    read it, cast to the same torch dtype (the flag's parser and the form's type both call `parse_dtype`)."""
    import torch

    from merge_engine import cli, options as declared

    canonical = DTYPE_SPELLINGS[spelling]
    form = MergeStepParams(run_root="s3://b/run", step=1, dtype=spelling).settings()["merge"].to_options()
    flags = cli.build_parser().parse_args(["merge", "--local_dir", "/c", "--target_dir", "/o", "--dtype", spelling])
    command_line = cli._options(cli.read_options(flags, declared.MergeArgs))
    assert form.dtype == command_line.dtype == canonical and type(form.dtype) is type(command_line.dtype) is str
    assert form.torch_dtype is command_line.torch_dtype is getattr(torch, canonical)
    assert form.output_options("merge")["dtype"] == command_line.output_options("merge")["dtype"] == canonical


@pytest.mark.parametrize("url, ok", [
    ("s3://bucket/run", True), ("gs://bucket/run", True), ("/data/run", True), ("file:///data/run", True),
    ("gs://b/a..b", True), ("ftp://host/run", False), ("s3://bucket/run/../x", False), ("s3://b/%2e%2e/x", False),
    ("s3://b/.%2E/x", False), ("../run", False), ("s3://", False), ("s3:///x", False), ("s3://b/run\x00", False),
    ("C:\\run", False), ("http://evil/x", False),
])
def test_the_servers_url_pattern_is_the_flows_url_check(url, ok):
    assert bool(re.match(URL_PATTERN, url)) is ok
    try:
        checked_url(url)
        checked = True
    except ValueError:
        checked = False
    assert checked is ok


@pytest.mark.parametrize("size, ok", [("5GB", True), ("500MiB", True), ("1.5 GB", True), ("1024", True),
                                      ("5gb", True), ("lots", False), ("5 GiBB", False), ("", False), ("-1GB", False)])
def test_the_size_pattern_admits_what_parse_size_reads(size, ok):
    assert bool(re.match(SIZE_PATTERN, size)) is ok
    if ok:
        assert parse_size(size) > 0


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
    {"dtype": "fp17"},
    {"weights_format": "gguf"},
    {"weights_format": None},
])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValidationError):
        MergeStepParams(**{"run_root": "s3://bucket/run", "step": 3, **bad})


def test_good_parameters_and_derived_settings():
    params = MergeStepParams(run_root="s3://bucket/run/", step=3, dtype="bfloat16", max_shard_size="500MiB")
    assert params.run_root == "s3://bucket/run"
    assert params.release_root_url == "s3://bucket/run/releases"
    assert params.key == "s3://bucket/run:actor:3"
    assert params.settings()["merge"].max_shard_size == 500 * 1024**2
    assert params.settings()["merge"].dtype == "bfloat16"
    assert MergeStepParams(run_root="/data/run", step=0, role="").release_root_url == "/data/run/releases"
    watch = WatchParams(run_root="gs://bucket/run", release_root="gs://bucket/releases")
    assert watch.release_root_url == "gs://bucket/releases"


def test_url_allow_list_is_configurable():
    assert checked_url("s3://b/run", schemes=("s3",), allow_local_paths=False) == "s3://b/run"
    with pytest.raises(ValueError):
        checked_url("/local/run", schemes=("s3",), allow_local_paths=False)
    with pytest.raises(ValueError):
        checked_url("gs://b/run", schemes=("s3",))


@pytest.mark.parametrize("flow", [merge_step, merge_new_steps, release_adapter], ids=lambda f: f.name)
def test_every_choice_is_a_visible_control_with_no_none_toggle(flow):
    """Issue 20: no "str | None" toggle with "Property is type None" under it; dtype is a dropdown whose first
    choice is "as stored"; an unset optional value is the blank its control shows (empty text, 0)."""
    props = flow.parameters.model_dump()["properties"]
    for name, prop in props.items():
        assert "null" not in json.dumps(prop.get("anyOf", [])) and prop.get("type") != "null", name
        assert prop.get("default", "required") is not None, name
        assert "type" in prop or "$ref" in prop or "allOf" in prop, name
    if "dtype" in props:
        assert props["dtype"]["default"] == AS_STORED and props["dtype"]["enum"][0] == AS_STORED


def test_the_blanks_are_read_as_unset_and_written_back_as_blanks():
    params = MergeStepParams(run_root="s3://b/run", step=1)
    assert (params.dtype, params.release_root, params.lora_alpha, params.workers, params.ray_address) == \
        (None, None, None, None, None)
    assert params.recorded_options()["dtype"] is None  # releases record what they always did
    sent = params.flow_parameters()
    assert sent["dtype"] == AS_STORED and sent["release_root"] == "" and sent["lora_alpha"] == 0
    assert MergeStepParams(**sent) == params  # what the watcher sends is what it meant
    assert MergeStepParams(run_root="s3://b/run", step=1, dtype=None, release_root=None).dtype is None


REGEX = re.compile(r"\^|\(\?|\[\^|\\\\|\$'|\{[0-9]")  # what a regular expression shows: ^ (?! [^ \\ $' {1


@pytest.mark.parametrize("flow, name, bad, words", [
    (merge_step, "run_root", "s3://bucket/run/../x", URL_WORDS), (merge_step, "run_root", "s3://" + "x" * 1100, URL_WORDS),
    (merge_step, "release_root", "ftp://x/y", f"empty, or {URL_WORDS}"), (merge_step, "max_shard_size", "lots", SIZE_WORDS),
    (merge_step, "ray_address", "not an address", f"empty, or {RAY_ADDRESS_WORDS}"),
    (release_adapter, "base_model", "C:\\model", f"empty, or {URL_WORDS}"),
    (verify_releases, "release_root", "ftp://x/releases", URL_WORDS),
], ids=["run_root", "run_root-too-long", "release_root", "max_shard_size", "ray_address", "adapter-base_model",
        "sweep-release_root"])
def test_the_server_refuses_a_bad_value_in_words_not_with_a_pattern(flow, name, bad, words):
    """What the server answers a bad ``--param`` or form value (its own validator, on the flow's schema):
    the field's name and what it expects, in words; the same words under the field in the form."""
    from prefect.utilities.schema_tools import ValidationError as SchemaError, validate

    schema = flow.parameters.model_dump()
    required = {"run_root": "s3://bucket/run", "step": 1, "release_root": "s3://bucket/run/releases"}
    values = {**{k: v for k, v in required.items() if k in schema["properties"]}, name: bad}
    with pytest.raises(SchemaError) as refused:
        validate(values, schema, raise_on_error=True)
    assert str(refused.value) == f"Validation failed for field {name!r}. Failure reason: {words!r} was expected"
    assert not REGEX.search(words), words


@pytest.mark.parametrize("name, bad, words", [
    ("max_shard_size", "lots", SIZE_WORDS), ("ray_address", "ray:/head:10001", RAY_ADDRESS_WORDS),
    ("run_root", "s3://bucket/run/../x", "'..'"), ("run_root", "ftp://x/y", "scheme 'ftp' is not allowed"),
])
def test_the_flow_refuses_a_bad_value_in_words_too(name, bad, words):
    """The flow's own check (a direct call, a run from an open schema) says the same, with the value it got."""
    with pytest.raises(ValidationError) as refused:
        MergeStepParams(**{"run_root": "s3://bucket/run", "step": 1, name: bad})
    (error,) = refused.value.errors()
    assert error["loc"] == (name,) and words in error["msg"] and not REGEX.search(error["msg"]), error["msg"]


def test_a_bad_parameter_fails_the_run_before_any_task(prefect):
    state = merge_step(run_root="s3://bucket/run", step=-5, return_state=True)
    assert state.is_failed()
    message = str(state.message)
    assert "step" in message and "greater than or equal to 0" in message  # names the field and the rule
    assert no_task_runs(flow_run_id(state))  # not one task ran


def test_lora_alpha_reaches_the_merge_and_its_cache_key():
    """The trained model of a LoRA run that recorded no alpha needs it as much as the adapter does."""
    params = MergeStepParams(run_root="s3://bucket/run", step=3, lora_alpha=16)
    assert params.settings()["merge"].lora_alpha == 16
    assert params.settings()["merge"].to_options().lora_alpha == 16
    assert params.settings()["adapter"].lora_alpha == 16
    assert params.settings()["merge"] != MergeStepParams(run_root="s3://bucket/run", step=3).settings()["merge"]


def test_weights_format_reaches_the_merge_its_cache_key_and_the_manifest():
    """The form's weights_format is the command line's --weights-format (default hub)."""
    default = MergeStepParams(run_root="s3://bucket/run", step=3)
    stored = MergeStepParams(run_root="s3://bucket/run", step=3, weights_format="transformers")
    assert default.settings()["merge"].to_options().weights_format == "hub"
    assert stored.settings()["merge"].to_options().weights_format == "transformers"
    assert stored.settings()["merge"] != default.settings()["merge"]  # another merge, not a cache hit
    assert stored.recorded_options()["weights_format"] == "transformers"
    # the step's adapter release names its base/ and modules the same way (extract-lora --weights-format)
    assert default.settings()["adapter"].to_options().weights_format == "hub"
    assert stored.settings()["adapter"].to_options().weights_format == "transformers"
    watch = WatchParams(run_root="s3://bucket/run", weights_format="transformers")
    assert watch.step_params(type("Step", (), {"step": 3, "role": "actor"})()).weights_format == "transformers"


def test_a_bad_weights_format_fails_the_run_before_any_task(prefect):
    state = merge_step(run_root="s3://bucket/run", step=5, weights_format="gguf", return_state=True)
    assert state.is_failed()
    assert "weights_format" in str(state.message)
    assert no_task_runs(flow_run_id(state))


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
