"""The engine's options are written, typed records, and every surface is made from them.

- the command line: each command's parser is derived from its record (`COMMAND_RECORDS` below):
  exactly its fields, each with its spellings (``--a_b`` and ``--a-b``, hidden ones taken but not listed), help,
  default, parser, choices and required-ness; every field has help and a resolvable type;
- the engine: `OutputOptions` is a literal dataclass whose every field is typed (``dtype`` a `Dtype`, sizes
  ``int``); a command's field sets the engine option of its name with the same default; what each output's
  fingerprint and provenance record (`OutputOptions.output_options`) is derived from the fields' markers and is
  pinned here, key for key, so no marker change goes unseen;
- a dtype spelling is read in one place (the flag's parser, the form's type); the engine names no flow or task;
- the flows' parameters and the settings records are written in flows/params.py and tasks/records.py
  (tests/flows/test_params.py checks them against `OutputOptions`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing

import pytest
import torch

from flows.cli import COMMANDS as STEPMERGE_COMMANDS, NotifyArgs
from merge_engine import options as declared
from merge_engine.cli import build_parser, read_options
from merge_engine.errors import InvalidOption
from merge_engine.output.jobs import OutputOptions
from merge_engine.option_values import DEFAULT_MAX_SHARD_SIZE, Dtype, WeightsFormat, parse_dtype

# each engine command's record (the order of ``stepmerge --help``)
COMMAND_RECORDS: dict[str, type] = {  # each engine command's record, in the order of ``stepmerge --help``
    "discover": declared.DiscoverArgs, "merge": declared.MergeArgs, "test": declared.TestArgs,
    "check": declared.CheckArgs, "verify": declared.VerifyArgs, "push": declared.PushArgs,
    "register": declared.RegisterArgs, "extract-lora": declared.ExtractLoraArgs, "merge-lora": declared.MergeLoraArgs,
    "split": declared.SplitArgs, "check-trained": declared.CheckTrainedArgs,
}
RECORDS = {**COMMAND_RECORDS, "notify": NotifyArgs}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(STEPMERGE_COMMANDS)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


@pytest.mark.parametrize("command", RECORDS)
def test_each_commands_flags_are_derived_from_its_record(command):
    parser, record = _subparsers()[command], RECORDS[command]
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            actions.setdefault(action.dest, []).append(action)
    fields = dataclasses.fields(record)
    assert set(actions) == {f.name for f in fields}  # nothing else, nothing left out
    hints = typing.get_type_hints(record)
    for item in fields:
        flag: declared.Flag = item.metadata[declared.FLAG]
        listed, *hidden = actions[item.name]
        assert tuple(listed.option_strings) == (() if flag.positional else flag.spellings(item.name)), item.name
        assert listed.help == flag.help and flag.help.strip(), item.name
        assert tuple(listed.choices or ()) == flag.choices, item.name
        assert listed.required is flag.required or flag.positional, item.name
        switch = hints[item.name] in (bool, bool | None)
        assert isinstance(listed, (argparse._StoreTrueAction, argparse._StoreFalseAction)) is switch, item.name
        if not (flag.required or flag.positional):
            assert listed.default == item.default, item.name
        assert [tuple(h.option_strings) for h in hidden] == ([flag.spellings(item.name, hidden=True)]
                                                             if flag.hidden_names else [])
        assert all(h.help == argparse.SUPPRESS for h in hidden)


def test_every_engine_command_has_a_record_and_every_record_field_a_type():
    assert set(_subparsers()) == set(RECORDS)
    for record in RECORDS.values():
        hints = typing.get_type_hints(record)  # every annotation resolves
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen
        for item in dataclasses.fields(record):
            assert hints[item.name] is not typing.Any and declared.FLAG in item.metadata, (record, item.name)


def test_verl_spellings_hidden_aliases_and_value_types_on_the_command_line():
    merge = _subparsers()["merge"]
    args = merge.parse_args(["--local-dir", "/ckpt", "--target_dir", "/out", "--tie-word-embedding",
                             "--dtype", "fp16", "--workers", "2", "--max-shard-size", "500MiB"])
    record = read_options(args, declared.MergeArgs)
    assert (record.local_dir, record.target_dir, record.tie_word_embedding, record.dtype, record.workers,
            record.max_shard_size) == ("/ckpt", "/out", True, "float16", 2, 500 * 1024**2)
    with pytest.raises(SystemExit):
        merge.parse_args(["--local_dir", "/c", "--target_dir", "/o", "--workers", "0"])  # a count is >= 1
    extract = _subparsers()["extract-lora"]
    for spelling in ("--adapter-only", "--adapter_only", "--no-include-base"):
        assert extract.parse_args(["--target_dir", "/o", spelling]).include_base is False
    assert extract.parse_args(["--target_dir", "/o"]).include_base is True
    assert "--adapter" not in extract.format_help()  # the hidden alias is taken, not listed
    merge_lora = _subparsers()["merge-lora"]
    record = read_options(merge_lora.parse_args(["--lora_adapter", "/a,/b", "--target_dir", "/o", "--lora-alpha",
                                                 "8,16", "--adapter-weights", "0.5,0.5"]), declared.MergeLoraArgs)
    assert (record.lora_adapter, record.lora_alpha, record.adapter_weights) == (("/a", "/b"), (8.0, 16.0), (0.5, 0.5))


def test_the_engine_options_record_is_written_and_typed():
    """Every field of `OutputOptions` is written in its class (no generated base) with a resolvable type."""
    assert OutputOptions.__mro__[1] is object
    source = inspect.getsource(OutputOptions)
    hints = typing.get_type_hints(OutputOptions)
    for item in dataclasses.fields(OutputOptions):
        assert f"    {item.name}: " in source and hints[item.name] is not typing.Any, item.name
    assert hints["dtype"] == (Dtype | None) and hints["max_shard_size"] is int
    assert hints["weights_format"] == WeightsFormat
    assert OutputOptions().max_shard_size == DEFAULT_MAX_SHARD_SIZE


@pytest.mark.parametrize(("field", "value"), [("dtype", "fp16"), ("dtype", "float64"), ("weights_format", "Hub"),
                                              ("max_shard_size", "5GB"), ("max_shard_size", 0)])
def test_the_engine_refuses_a_value_not_made_canonical_where_it_was_given(field, value):
    with pytest.raises(InvalidOption):
        OutputOptions(**{field: value})


@pytest.mark.parametrize("command", COMMAND_RECORDS)
def test_a_commands_fields_set_the_engine_options_of_their_names_with_the_same_defaults(command):
    engine = {f.name: f for f in dataclasses.fields(OutputOptions)}
    engine_hints = typing.get_type_hints(OutputOptions)
    record = COMMAND_RECORDS[command]
    hints = typing.get_type_hints(record)
    for item in dataclasses.fields(record):
        flag: declared.Flag = item.metadata[declared.FLAG]
        target = flag.sets or item.name
        assert not flag.sets or flag.sets in engine, item.name
        if target in engine and not (flag.required or flag.positional):
            assert item.default == engine[target].default, (command, item.name)
            wanted = set(typing.get_args(engine_hints[target])) or {engine_hints[target]}
            given = set(typing.get_args(hints[item.name])) or {hints[item.name]}
            assert given <= wanted or hints[item.name] == engine_hints[target], (command, item.name)


# What each output records (fingerprint and provenance keys): always, and only when set. These keys are in
# every published release's stepmerge.json; a change here changes outputs' identity.
RECORDED = {
    "merge": ({"dtype", "max_shard_size", "hf_model_path", "weights_format"},
              {"custom_mapping", "mtp_layers", "lora_alpha"}),
    "extract-lora": ({"backend", "dtype", "max_shard_size", "hf_model_path", "weights_format", "write_base",
                      "lora_alpha", "base_model"}, {"base_model_id"}),
    "extract-lora --finetuned": ({"backend", "dtype", "rank", "energy", "target_modules"}, set()),
    "merge-lora": ({"dtype", "max_shard_size", "weights_format", "lora_alpha", "method", "weights", "output",
                    "rank", "energy"}, {"base_model_id"}),
    "split": ({"dtype", "custom_mapping", "tp", "pp", "vpp", "ep", "format", "make_vocab_size_divisible_by"}, set()),
}
SET = {"custom_mapping": None, "mtp_layers": "drop", "lora_alpha": 2.0, "base_model_id": "org/base"}  # a set value


@pytest.mark.parametrize("output", declared.OUTPUTS)
def test_an_outputs_recorded_options_are_derived_from_the_markers(output):
    always, when_set = RECORDED[output]
    derived = declared.recorded_fields(OutputOptions, output)
    assert {key for key, _ in derived.values()} == always | when_set
    assert {key for key, kept in derived.values() if kept} == always
    assert set(OutputOptions().output_options(output)) == always
    values = {name: SET[name] for name, (key, kept) in derived.items() if not kept and name != "custom_mapping"}
    assert set(OutputOptions(**values).output_options(output)) == always | (when_set - {"custom_mapping"})


def test_a_dtype_spelling_is_read_in_one_place_and_the_engine_names_no_flow_or_task():
    """A dtype spelling is read by `merge_engine.option_values.parse_dtype` alone, which the command line's flag
    parser and the flows' form type name (no module of the product reads `DTYPE_SPELLINGS` or wraps the parse);
    the name becomes a torch dtype in one place, `OutputOptions.torch_dtype` (no command converts it); no engine
    module names ``flows.`` or ``tasks.`` in a string."""
    import ast
    import pathlib

    from merge_engine.plan import merge_plan

    root = pathlib.Path(declared.__file__).resolve().parent.parent
    readers, converters, names = [], [], []
    for package in ("merge_engine", "flows", "tasks"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            relative = str(path.relative_to(root))
            imported = {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
                        for alias in node.names}
            if imported & {"DTYPE_SPELLINGS", "parse_dtype"} or "option_values.parse_dtype(" in text:
                readers.append(relative)
            if "TORCH_DTYPES" in text:
                converters.append(relative)
            if package == "merge_engine" and any(
                    word in text for word in ('"flows.', '"tasks.', "'flows.", "'tasks.", "flows.params")):
                names.append(relative)
    assert readers == ["merge_engine/options.py", "flows/params.py"]  # the flag's parser, the form's type
    assert converters == ["merge_engine/output/jobs.py"]
    assert not hasattr(merge_plan, "torch_dtype") and not hasattr(merge_plan, "DTYPES")
    assert all(item.metadata[declared.FLAG].parse is parse_dtype for record in COMMAND_RECORDS.values()
               for item in dataclasses.fields(record) if item.name == "dtype")
    assert typing.get_type_hints(OutputOptions.torch_dtype.fget)["return"] == (torch.dtype | None)
    assert names == []


def test_the_output_dtype_is_applied_to_the_plan_in_one_place():
    """No planner takes a dtype: each plans every tensor in its stored dtype. Every command that writes a model
    hands `in_weights_format` (which shards, and so fixes every size) a plan cast by `MergePlan.with_dtype`, the
    one place ``options.torch_dtype`` becomes the planned tensors' dtype."""
    import ast
    import pathlib

    from merge_engine.architectures.megatron_to_hf import plan_megatron_merge, plan_megatron_to_hf
    from merge_engine.lora.checkpoint import plan_trained_model
    from merge_engine.lora.fuse import plan_fused_model
    from merge_engine.plan.hf_plan import plan_hf_merge
    from merge_engine.planner import plan_checkpoint

    planners = (plan_checkpoint, plan_hf_merge, plan_megatron_merge, plan_megatron_to_hf, plan_trained_model,
                plan_fused_model)
    assert [p.__name__ for p in planners if "dtype" in inspect.signature(p).parameters] == []
    root = pathlib.Path(declared.__file__).resolve().parent
    calls, uncast = 0, []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("in_weights_format"):
                calls += 1
                plan = node.args[0]
                if not (isinstance(plan, ast.Call) and isinstance(plan.func, ast.Attribute)
                        and plan.func.attr == "with_dtype"):
                    uncast.append(f"{path.relative_to(root)}:{node.lineno}")
    assert calls >= 6 and uncast == []


def test_layout_messages_name_the_flags_the_merge_command_takes():
    from merge_engine.layouts import megatron_lora

    merge = _subparsers()["merge"]
    for need, spelling in megatron_lora.CLI_FLAGS.items():
        assert merge._option_string_actions[spelling].dest == need
    assert megatron_lora.CLI_FLAGS[megatron_lora.NEEDS_BASE_MODEL] in megatron_lora.ADAPTER_ONLY_REASON

