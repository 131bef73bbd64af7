"""Cache keys: made of what the output depends on (listing fingerprint, options, engine version), nothing else.

A key is computed from the records a task receives, as canonical JSON: equal records give equal
keys in any process; a change of a file's version, an option or the engine version gives a new key;
fields a stage does not depend on (timings) do not count.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import merge_engine
from tasks.cache import stage_key
from merge_engine.release.built import BuiltOutput
from tasks.records import SETTINGS_RECORDS, CheckpointRecord

MergeSettings, AdapterSettings, ValidationSettings = (SETTINGS_RECORDS[r] for r in ("merge", "adapter", "validation"))
CHECKPOINT = CheckpointRecord(url="s3://b/run/global_step_3/actor", layout="fsdp", fingerprint="f" * 64,
                              files=(("model_world_size_2_rank_0.pt", 100, "etag-a"),
                                     ("model_world_size_2_rank_1.pt", 100, "etag-b")))
FIELDS = ("checkpoint", "settings", "release")
RELEASE = "s3://b/run/releases/actor/global_step_3"


def merge_key(checkpoint=CHECKPOINT, settings=MergeSettings(), release=RELEASE) -> str:
    return stage_key("merge", {"checkpoint": checkpoint, "settings": settings, "release": release,
                               "staging_root": "/tmp/whatever"}, FIELDS)


def test_equal_inputs_give_equal_keys_even_in_another_process():
    key = merge_key()
    assert key == merge_key(CheckpointRecord(**CHECKPOINT.model_dump()), MergeSettings())
    assert key.startswith("stepmerge-merge-")
    code = ("from tests.tasks.test_cache import merge_key; print(merge_key())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == key


def test_a_changed_file_version_option_or_engine_gives_a_new_key(monkeypatch):
    key = merge_key()
    rewritten = CHECKPOINT.model_copy(update={"files": (("model_world_size_2_rank_0.pt", 100, "etag-NEW"),
                                                         CHECKPOINT.files[1])})
    assert merge_key(rewritten) != key
    assert merge_key(settings=MergeSettings(dtype="bfloat16")) != key
    assert merge_key(release=RELEASE + "-other") != key
    monkeypatch.setattr(merge_engine, "OUTPUT_REVISION", merge_engine.OUTPUT_REVISION + 1)
    assert merge_key() != key  # same engine version, other bytes written: never the cached output
    monkeypatch.setattr(merge_engine, "__version__", "9.9.9")
    assert merge_key() != key


def test_only_the_named_fields_count():
    assert merge_key() == stage_key("merge", {"checkpoint": CHECKPOINT, "settings": MergeSettings(),
                                              "release": RELEASE, "staging_root": "/elsewhere"}, FIELDS)
    output = BuiltOutput(kind="model", source_url="x", url="/stage/a", fingerprint="abc", seconds=1.0)
    fields = ("output.fingerprint", "output.url")
    same_but_slower = replace(output, seconds=99.0)
    key = stage_key("validate", {"output": output}, fields)
    assert key == stage_key("validate", {"output": same_but_slower}, fields)
    assert stage_key("validate", {"output": output}, fields) != stage_key(
        "validate", {"output": replace(output, fingerprint="abd")}, fields)
    assert stage_key("validate", {"output": output}, fields) != stage_key("publish", {"output": output}, fields)


def _task_key(stage_task, **inputs) -> str:
    """The key the task's own cache policy computes for these inputs (no result store: generation 0)."""
    from types import SimpleNamespace

    return stage_task.cache_policy.compute_key(SimpleNamespace(result_store=None), inputs, {})


def test_folders_named_by_url_count_by_their_content(tmp_path):
    """hf_model_path (merge, extract) and reference_url (validate) are folders whose CONTENT decides
    the output or the verdict: the key follows their listing, not just their name."""
    from merge_engine.release.folders import ADAPTER, MODEL
    from tasks.build import BuildSpec, extract_adapter, merge_model
    from tasks.records import StepRecord
    from tasks.validate import validate_output

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    output = BuiltOutput(kind="model", source_url="x", url="/stage/a", fingerprint="abc", attempt="1")
    step = StepRecord(run_root="s3://b/run", step=3, role="actor", url=CHECKPOINT.url, status="complete",
                      layout="fsdp", fingerprint="s" * 64)

    def keys() -> tuple[str, ...]:
        return (
            _task_key(merge_model, spec=BuildSpec(MODEL, step.fingerprint, CHECKPOINT,
                                                  MergeSettings(hf_model_path=str(folder))),
                      release=RELEASE, staging_root=None),
            _task_key(extract_adapter, spec=BuildSpec(ADAPTER, step.fingerprint, CHECKPOINT,
                                                      AdapterSettings(hf_model_path=str(folder))),
                      release=RELEASE + "-adapter", staging_root=None),
            _task_key(extract_adapter, spec=BuildSpec(ADAPTER, step.fingerprint, CHECKPOINT,
                                                      AdapterSettings(base_model=str(folder))),
                      release=RELEASE + "-adapter", staging_root=None),
            _task_key(validate_output, output=output, settings=ValidationSettings(reference_url=str(folder)),
                      release=RELEASE),
        )

    before = keys()
    assert before == keys()  # stable while the folder is unchanged
    (folder / "config.json").write_text('{"rope_theta": 1000000}')  # same name, new content
    after = keys()
    assert all(a != b for a, b in zip(before, after))
