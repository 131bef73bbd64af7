"""Cache keys: made of what the output depends on (listing fingerprint, options, engine version), nothing else.

A key is computed from the records a task receives, as canonical JSON: equal records give equal
keys in any process; a change of a file's version, an option or the engine version gives a new key;
fields a stage does not depend on (timings) do not count.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

import merge_engine
from tasks.cache import stage_cache_policy, stage_key
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


def _policy_key(policy, **inputs) -> str:
    """The key ``policy`` computes for these task inputs (a guarded store with no records: generation 0; no task
    run)."""
    from types import SimpleNamespace

    from tasks.results import GuardedLocalFileSystem

    store = SimpleNamespace(result_storage=GuardedLocalFileSystem(basepath="/nonexistent"), metadata_storage=None,
                            exists=lambda key: False)
    return policy.compute_key(SimpleNamespace(result_store=store), inputs, {})


def test_a_store_that_is_not_guarded_gets_no_key():
    """Prefect's own local storage (a record there names its own serializer), or no store at all: no key, so the
    task runs and reads no record."""
    from types import SimpleNamespace

    from prefect.filesystems import LocalFileSystem

    policy = stage_cache_policy("t", ("x",))
    prefects_own = SimpleNamespace(result_storage=LocalFileSystem(basepath="/nonexistent"), metadata_storage=None)
    for store in (None, prefects_own):
        assert policy.compute_key(SimpleNamespace(result_store=store), {"x": 1}, {}) is None
    assert _policy_key(policy, x=1) is not None


def test_folders_named_by_url_count_by_their_content(tmp_path):
    """A folder whose CONTENT decides the output (a config folder, a base, a reference) counts by its listing, not
    its name (the chains' folders: tests/flows/test_stages.py)."""
    from tasks.cache import stage_cache_policy

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    policy = stage_cache_policy("probe", ("x",), listed=("folder",))
    before = _policy_key(policy, x=1, folder=str(folder))
    assert before == _policy_key(policy, x=1, folder=str(folder))  # stable while the folder is unchanged
    assert before != _policy_key(policy, x=1, folder=None)
    (folder / "config.json").write_text('{"rope_theta": 1000000}')  # same name, new content
    assert _policy_key(policy, x=1, folder=str(folder)) != before


def test_a_task_body_reads_its_folders_by_the_listing_its_key_took(prefect, tmp_path, monkeypatch):
    """The folder is listed once per task run: by its key, into the `InputFolders` the caller passes the task as its
    ``folders`` parameter, which the body then reads; each run gets its own (nothing is kept between runs), and a
    ``folders`` that is no `InputFolders` (a listing made up by the caller) is refused, not hashed."""
    from prefect import flow, task

    from merge_engine.commands.input_folders import InputFolders
    from merge_engine.storage.backends.local import LocalBackend
    from tasks import cache
    from tasks.cache import stage_cache_policy
    from tasks.result_records import RECORD_SERIALIZER

    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    listings: list[str] = []
    list_files = LocalBackend.list_files
    monkeypatch.setattr(LocalBackend, "list_files", lambda self, url, recursive:
                        listings.append(url.rstrip("/")) or list_files(self, url, recursive))

    @task(cache_policy=stage_cache_policy("handed", ("folder",), listed=("folder",)), persist_result=True,
          result_serializer=RECORD_SERIALIZER)
    def body(folder: str, folders: InputFolders) -> str:
        return ",".join(entry.path for entry in folders.files(folder))

    given = [InputFolders(), InputFolders()]

    @flow
    def run(folder: str) -> list:
        from tasks.results import configured_result_storage

        # a stage task gets a key only with guarded result storage (the flows' StageTimer applies it)
        cached = body.with_options(result_storage=configured_result_storage())
        return [cached(folder, given[0]), cached.with_options(refresh_cache=True)(folder, given[1])]

    assert run(str(folder)) == ["config.json", "config.json"]
    assert listings == [str(folder), str(folder)]  # one listing per run, by its key; none by the body
    assert [[e.path for e in folders.files(str(folder))] for folders in given] == [["config.json"]] * 2
    assert listings == [str(folder), str(folder)]  # each run's own object holds its listing
    assert not [name for name, value in vars(cache).items() if isinstance(value, dict) and not name.startswith("__")]
    forged = {str(folder): [("config.json", 2, "v")]}
    with pytest.raises(TypeError, match="not the InputFolders"):
        stage_cache_policy("handed", ("folder",), listed=("folder",)).cache_key_fn(
            None, {"folder": str(folder), "folders": forged})
