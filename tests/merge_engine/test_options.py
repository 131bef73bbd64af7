"""Every option is declared once (`merge_engine.options`) and every surface is made from the declarations.

- the command line: each command's parser holds exactly its declared options, each with the declared
  spellings (``--a_b`` and ``--a-b``), help, default, choices and required-ness, and nothing undeclared;
- the flows: each flow's Prefect schema (the form) holds exactly its declared parameters, in order (the
  required ones first), each with the declared description and default (the blank of an unset one), and the
  signature Prefect reads is the parameter model's;
- the settings records: one field per declared option of the record, with its default;
- the engine: `OutputOptions` has one field per declared engine option, with its default; what a command's
  fingerprint and provenance record (`OutputOptions.output_options`) and what a flow's release manifest
  records (`recorded_options`) are the options declared to shape that output;
- the declarations themselves are consistent: known kinds, commands, flows, outputs and records, a form
  text for every flow parameter and a help text for every listed flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from flows.cli import COMMANDS as STEPMERGE_COMMANDS
from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import AdapterParams, MergeStepParams, WatchParams, blank_of, form_type
from flows.release_adapter import release_adapter
from merge_engine import options as declared
from merge_engine.cli import build_parser
from merge_engine.output.jobs import OutputOptions
from merge_engine.option_values import parse_size
from tasks.records import SETTINGS_RECORDS

FLOWS = {"merge_step": (merge_step, MergeStepParams), "merge_new_steps": (merge_new_steps, WatchParams),
         "release_adapter": (release_adapter, AdapterParams)}
SAMPLES = {"text": "x", "url": "/x", "int": 1, "count": 1, "float": 0.5, "alpha": 2.0, "floats": (1.0,),
           "names": ("q_proj",), "bool": True, "size": 1000, "dtype": "float16", "ray_address": "auto"}  # a set value


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(STEPMERGE_COMMANDS)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_the_declarations_are_consistent():
    names = [o.name for o in declared.OPTIONS]
    assert len(names) == len(set(names))
    assert set(_subparsers()) == set(declared.COMMANDS)
    for option in declared.OPTIONS:
        assert option.kind in declared.KINDS, option.name
        assert set(option.commands) <= set(declared.COMMANDS), option.name
        assert set(option.flows) <= set(declared.FLOWS), option.name
        assert {s.rstrip("?") for s in option.shapes} <= set(declared.OUTPUTS), option.name
        assert set(option.settings) <= set(declared.SETTINGS), option.name
        assert bool(option.form) == bool(option.flows), option.name  # a form text exactly where there is a form
        assert option.kind not in ("choice", "choices") or option.choices, option.name
        if option.flows:  # its kind names a form type, one with a blank for "unset" where it may be unset
            kind = declared.KINDS[option.kind]
            assert (kind.form_unset if option.default is None else kind.form), option.name
            if option.default is None:
                blank_of(form_type(option))
        for command in option.commands:
            use = option.use(command)
            assert use.kind in declared.KINDS and (use.help or option.hidden), (option.name, command)


def test_each_kind_of_value_is_declared_in_one_table():
    """`merge_engine.options.KINDS` is the only table keyed by kinds of value in the product: no surface (the
    command line, the forms, the settings records, the engine) keeps its own per-kind mapping; and every form
    type a kind names is there."""
    import ast
    import pathlib

    root = pathlib.Path(declared.__file__).resolve().parents[1]
    kinds, tables = set(declared.KINDS) - {"int", "float", "bool"}, []  # not the names of Python types
    for package in ("merge_engine", "tasks", "flows", "deployments"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Dict):
                    keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                    if len(keys & kinds) >= 3:
                        tables.append(f"{path.relative_to(root)}:{node.lineno}")
    assert tables == []
    for kind in declared.KINDS.values():
        for entry in filter(None, (kind.form, kind.form_unset)):
            module, _, name = entry.partition(":")
            assert module == "flows.params" and hasattr(__import__(module, fromlist=[name]), name), entry


@pytest.mark.parametrize("command", declared.COMMANDS)
def test_each_command_takes_exactly_its_declared_options(command):
    parser = _subparsers()[command]
    actions = {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}
    options = declared.for_command(command)
    assert list(actions) == [o.name for o in options]  # nothing undeclared, in declaration order
    for option in options:
        action, use = actions[option.name], option.use(command)
        assert tuple(action.option_strings) == (() if option.positional else option.spellings)
        assert action.help == (argparse.SUPPRESS if option.hidden else use.help)
        assert action.required is use.required or option.positional
        assert tuple(action.choices or ()) == option.choices
        assert isinstance(action, argparse._StoreTrueAction) is (use.kind == "bool")
        if not use.required:
            assert action.default == (None if option.required else option.default), option.name


def test_verl_spellings_and_value_kinds_on_the_command_line():
    merge = _subparsers()["merge"]
    args = merge.parse_args(["--local-dir", "/ckpt", "--target_dir", "/out", "--tie-word-embedding",
                             "--dtype", "fp16", "--workers", "2"])
    assert (args.local_dir, args.target_dir, args.tie_word_embedding, args.dtype, args.workers) == \
        ("/ckpt", "/out", True, "float16", 2)
    with pytest.raises(SystemExit):
        merge.parse_args(["--local_dir", "/c", "--target_dir", "/o", "--workers", "0"])  # a count is >= 1


@pytest.mark.parametrize("flow", declared.FLOWS)
def test_each_flow_form_holds_exactly_its_declared_parameters(flow):
    function, model = FLOWS[flow]
    schema = function.parameters.model_dump()
    options = declared.for_flow(flow)
    assert list(schema["properties"]) == [o.name for o in options]
    assert sorted(schema["properties"], key=lambda n: schema["properties"][n]["position"]) == [o.name for o in options]
    assert schema["required"] == [o.name for o in options if o.required]
    for option in options:
        prop = schema["properties"][option.name]
        assert prop["description"] == option.form, option.name
        if not option.required:
            expected = blank_of(form_type(option)) if option.default is None else (
                list(option.default) if option.kind == "choices" else option.default)
            assert prop["default"] == expected, option.name
        if option.choices:
            enum = prop["items"]["enum"] if option.kind == "choices" else prop["enum"]
            assert enum == list(option.choices), option.name
    signature = inspect.signature(function.fn)
    assert list(signature.parameters) == list(model.model_fields) == [o.name for o in options]


@pytest.mark.parametrize("record", declared.SETTINGS)
def test_each_settings_record_has_one_field_per_declared_option(record):
    fields = SETTINGS_RECORDS[record].model_fields
    expected = {declared.setting_name(o, record): o for o in reversed(declared.for_settings(record))}
    assert set(fields) == set(expected)
    for name, option in expected.items():
        default = parse_size(option.default) if option.kind == "size" else option.default
        assert fields[name].default == default, name


def test_one_settings_record_per_declared_name_pickled_by_its_name():
    """Each name of `SETTINGS` is a settings class (its record, its text); a record survives pickle and
    cloudpickle (Prefect's results, Ray's task arguments) as an equal record of the same class."""
    import pickle

    import cloudpickle

    assert list(SETTINGS_RECORDS) == list(declared.SETTINGS)
    for name, record in SETTINGS_RECORDS.items():
        assert record.record == name and record.__doc__ == declared.SETTINGS[name]
        value = record()
        for dumps in (pickle.dumps, cloudpickle.dumps):
            again = pickle.loads(dumps(value))
            assert type(again) is record and again == value and again.model_fields_set == value.model_fields_set
    changed = SETTINGS_RECORDS["merge"](dtype="bfloat16", max_shard_size=1000)
    again = pickle.loads(pickle.dumps(changed))
    assert again == changed and again.model_fields_set == {"dtype", "max_shard_size"}


def test_the_engine_options_record_has_one_field_per_declared_engine_option():
    fields = {f.name: f for f in dataclasses.fields(OutputOptions)}
    engine = declared.fields()
    assert set(fields) - {"chunk_bytes"} == set(engine)  # chunk_bytes: how to read, no one's option
    for name, option in engine.items():
        default = parse_size(option.default) if option.kind == "size" else option.default
        assert fields[name].default == default, name


@pytest.mark.parametrize("output", [o for o in declared.OUTPUTS if o not in declared.FLOWS])
def test_a_commands_recorded_options_are_the_declared_ones(output):
    """Every engine option set (to a non-default value): the fingerprint/provenance keys are exactly the options
    declared to shape ``output`` (those recorded only when set included)."""
    when_set = [o for o in declared.recorded(output) if o.records(output) is None
                and o.field != "custom_mapping"]  # merge reads a mapping file to record its digest
    everything_set = OutputOptions(**{o.field: o.choices[0] if o.choices else SAMPLES[o.kind] for o in when_set})
    recorded = set(everything_set.output_options(output))
    assert recorded == {o.field for o in declared.recorded(output)} - (
        {"custom_mapping"} if output == "merge" else set())
    assert set(OutputOptions().output_options(output)) == {o.field for o in declared.recorded(output)
                                                          if o.records(output) and o.field}


@pytest.mark.parametrize("flow", ["merge_step", "release_adapter"])
def test_a_flows_recorded_options_are_the_declared_ones(flow):
    _, model = FLOWS[flow]
    params = model(run_root="s3://bucket/run", step=1)
    assert set(params.recorded_options()) == {o.name for o in declared.recorded(flow)}
