"""Forged records in Prefect's result storage (issue 26): nothing in them runs, nothing outside the step is read.

Specification:
- the stage tasks and flows store their results with `RecordSerializer` (JSON of an exact table of records);
  reading one back builds the record by its constructor; a pickle, a document naming a type outside the table
  (or Prefect's JSON ``__class__`` form naming ``subprocess.Popen``) or a malformed field is `UnsafeRecord`;
- the result storage blocks the flows use read only such records: a record naming Prefect's pickle serializer
  (or ``picklelib`` naming another module) is `UnsafeRecord` naming its key, before Prefect deserialises it,
  whatever the pickle holds (one payload of `tests.forged_pickles` that Prefect's own reading runs stands for
  all); no marker file, no child process;
- end to end, a forged pickle planted at the very key of a step's check task (one that runs a process when
  Prefect reads it unguarded) is never loaded: the flow's check runs again (and overwrites it), the next run is
  served from the cache (caching still works), nothing runs;
- a cached check record carries no tensor index: one planted with an index giving a name another tensor's
  bytes changes no weight of the release;
- a cached check record (JSON, well formed) that names another place is refused by the flow
  (`CheckpointRecord.verified_for`): a URL outside the step (host file, other bucket, other step), a file
  path leaving the checkpoint, a file the step's listing does not hold.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest
from prefect import flow

from flows.stages import StageTimer, ready_checkpoint
from merge_engine.errors import UnsafeRecord
from merge_engine.layouts.discovery import discover_step
from tasks.cache import stage_key
from tasks.records import CheckpointRecord, StepRecord
from tasks.result_records import RECORD_SERIALIZER, checked_record
from tests.fixtures_pipeline import copy_steps
from tests.forged_pickles import BY_ID, INDEX_MODULE, Inert, forged


def _record(serializer: dict, result: bytes) -> bytes:
    """A result record as Prefect writes one: metadata naming the serializer, and the serialized result."""
    return json.dumps({"metadata": {"storage_key": "k", "expiration": None, "serializer": serializer,
                                    "prefect_version": "3.9.1", "storage_block_id": None},
                       "result": base64.b64encode(result).decode()}).encode()


def test_a_forged_pickle_record_is_refused_unread(tmp_path):
    from prefect.results import ResultRecord

    marker = tmp_path / "pwned"
    gadget, protocol, opcode = BY_ID["exec-p5-STACK_GLOBAL"]
    payload = forged(gadget, marker, protocol, opcode, INDEX_MODULE)
    serializers = ({"type": "pickle"}, {"type": "pickle", "picklelib": "pickle"},
                   {"type": "stepmerge-records", "picklelib": "pickle"})
    with Inert(marker):
        for serializer in serializers:
            with pytest.raises(UnsafeRecord) as error:
                checked_record(_record(serializer, payload), "stepmerge-check-forged")
            assert error.value.path == "stepmerge-check-forged"
        with pytest.raises(UnsafeRecord):  # the serializer itself never unpickles either
            RECORD_SERIALIZER.loads(payload)
    ResultRecord.deserialize(_record(serializers[1], payload)).result  # what Prefect reads unguarded: it runs
    assert marker.exists()


@pytest.mark.parametrize("document", [
    {"format": 1, "type": "subprocess.Popen", "data": ["sh", "-c", "id"]},
    {"format": 1, "type": "__class__", "data": {}},
    {"__class__": "subprocess.Popen", "data": {"args": ["sh", "-c", "id"]}},  # Prefect's JSON object form
    {"format": 1, "type": "error", "data": {"class": "os.system", "message": "id", "path": None, "x": 1}},
    {"format": 1, "type": "CheckpointRecord", "data": {"url": "u", "layout": "fsdp", "fingerprint": "f",
                                                       "files": "not a listing"}},
    {"format": 1, "type": "CheckpointRecord", "data": {"url": "u", "layout": "fsdp", "fingerprint": "f",
                                                       "files": [], "index": None, "extra": "field"}},
    {"format": 1, "type": "BuiltOutput", "data": {"kind": "model", "source_url": "a", "url": "b",
                                                  "fingerprint": "c", "tensors": "many"}},
    {"format": 2, "type": "None", "data": None},
], ids=["type_named_popen", "dunder_type", "prefect_json_class", "error_with_extra", "files_not_a_listing",
        "extra_field", "count_not_a_number", "other_format"])
def test_a_result_document_outside_the_table_is_refused(document):
    with pytest.raises(UnsafeRecord):
        RECORD_SERIALIZER.loads(json.dumps(document).encode())


def test_a_stored_error_comes_back_named_or_as_text():
    from merge_engine.errors import CorruptShard
    from tasks.result_records import RemoteError

    named = RECORD_SERIALIZER.loads(RECORD_SERIALIZER.dumps(CorruptShard("bad header", "s3://b/x.pt")))
    assert type(named) is CorruptShard and named.path == "s3://b/x.pt"
    other = RECORD_SERIALIZER.loads(RECORD_SERIALIZER.dumps(KeyError("k")))
    assert type(other) is RemoteError and "KeyError" in str(other)


# --- end to end: the check task of a real step --------------------------------------------------------


@flow
def _checked(run_root: str) -> CheckpointRecord:
    return ready_checkpoint(StageTimer(), run_root, 1, "actor").checkpoint


def _check_key(run_root: str) -> tuple[StepRecord, str]:
    step = StepRecord.from_step(discover_step(run_root, 1, "actor"))
    return step, stage_key("check", {"step": step, "backend": None}, ("step", "backend"))


def test_a_forged_check_record_at_its_key_is_never_loaded(prefect, template_run, tmp_path, monkeypatch):
    """The payload is the Popen gadget issue 26 ran, in an encoding a plain unpickler runs."""
    import tasks.check

    gadget, protocol, opcode = BY_ID["popen_dotted-p4-STACK_GLOBAL"]
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    _, key = _check_key(run_root)
    marker = tmp_path / "pwned"
    planted = prefect.results / key
    planted.write_bytes(_record({"type": "pickle", "picklelib": "pickle"},
                                forged(gadget, marker, protocol, opcode, INDEX_MODULE)))
    checks = []
    real = tasks.check.check_checkpoint
    monkeypatch.setattr(tasks.check, "check_checkpoint", lambda *a, **k: checks.append(a[0]) or real(*a, **k))
    with Inert(marker):
        first = _checked(run_root)
        assert checks and first.index is not None  # the forged record was not a result: the check ran
        assert json.loads(planted.read_bytes())["metadata"]["serializer"] == {"type": "stepmerge-records"}  # replaced
        again = _checked(run_root)
    assert len(checks) == 1 and again.index is None  # served from the cache, as JSON, without its index
    assert again.model_copy(update={"index": first.index}) == first


def _plant(path, document: dict) -> None:
    """A well-formed stepmerge result record holding ``document`` at ``path`` (a task's cache key)."""
    planted = json.loads(_record({"type": "stepmerge-records"}, b""))
    planted["result"] = json.dumps(document)  # as Prefect stores this serializer's bytes: the JSON text itself
    path.write_text(json.dumps(planted))


def _swapped(index: bytes, first: str, second: str) -> bytes:
    """``index`` (a carried torch-archive index) with the table entries of two tensors of one shape swapped: every
    file, storage and view still valid, each name now on the other's bytes."""
    import zlib

    from merge_engine.layouts import tensor_index

    tag = tensor_index._tag()
    document = json.loads(zlib.decompress(index[len(tag):]))
    table = {entry[0]: entry for entry in document["tensors"]}
    assert table[first][1:3] == table[second][1:3]  # the same kind and shape
    document["tensors"] = [[name, *table[{first: second, second: first}.get(name, name)][1:]]
                           for name in table]
    return tag + zlib.compress(json.dumps(document).encode())


def test_a_cached_check_carrying_a_forged_index_changes_no_weight(prefect, template_run, tmp_path):
    """A well-formed check record at the step's key, its files and places the step's own, its tensor index
    mapping q_proj's name to o_proj's bytes and back: the index is not read back from the store, the release
    holds the step's weights bit for bit (before: q_proj and o_proj swapped, every check passing)."""
    from flows.merge_step import merge_step
    from flows.params import MergeStepParams
    from merge_engine.layouts import check_checkpoint
    from tests.release_checks import assert_release_weights_equal

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    step, key = _check_key(run_root)
    good = CheckpointRecord.from_checkpoint(check_checkpoint(step.url, None, step.listing()))
    layer = "model.layers.0.self_attn"
    document = {"format": 1, "type": "CheckpointRecord",
                "data": {**good.model_dump(mode="json"), "index": base64.b64encode(
                    _swapped(good.index, f"{layer}.q_proj.weight", f"{layer}.o_proj.weight")).decode()}}
    _plant(prefect.results / key, document)
    assert _checked(run_root).index is None  # the planted record is the cache hit, its index not taken

    outcome = merge_step(**MergeStepParams(run_root=run_root, step=1,
                                           staging_root=str(tmp_path / "staging")).flow_parameters())
    (release,) = outcome.releases
    assert_release_weights_equal(release.url, template_run.reference_weights(1))


@pytest.mark.parametrize("forge", ["host_file", "other_bucket", "other_step", "file_outside", "file_not_listed",
                                   "config_outside", "adapter_outside", "adapter_not_listed"])
def test_a_cached_check_naming_another_place_is_refused(forge, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    step, _ = _check_key(run_root)
    from merge_engine.layouts import check_checkpoint

    good = CheckpointRecord.from_checkpoint(check_checkpoint(step.url, None, step.listing()))
    assert good.verified_for(step) is good
    first = good.files[0]
    forged_record = {
        "host_file": lambda: good.model_copy(update={"url": "/etc"}),
        "other_bucket": lambda: good.model_copy(update={"url": "s3://another-bucket/run/global_step_1/actor"}),
        "other_step": lambda: good.model_copy(update={"url": good.url.replace("global_step_1", "global_step_2")}),
        "file_outside": lambda: good.model_copy(update={"files": (("../../../etc/passwd", *first[1:]),)}),
        "file_not_listed": lambda: good.model_copy(update={"files": ((first[0], first[1] + 1, first[2]),)}),
        "config_outside": lambda: good.model_copy(update={"hf_dir": "s3://another-bucket/config"}),
        "adapter_outside": lambda: good.model_copy(update={"adapter_dir": "../global_step_2/actor/lora_adapter/"}),
        # a folder inside the step that the check did not list as the PEFT folder (it would choose the alpha)
        "adapter_not_listed": lambda: good.model_copy(update={"adapter_dir": "huggingface/other/"}),
    }[forge]()
    with pytest.raises(UnsafeRecord) as error:
        forged_record.verified_for(step)
    assert error.value.path == forged_record.url


@pytest.mark.parametrize("forge", ["other_release", "host_folder", "other_source", "other_kind", "other_fingerprint"])
def test_a_stored_release_record_of_another_output_is_not_used(forge, tmp_path):
    """An output's one record (`flows.stages.ReleasedOutput`) says what was released where: one that is not of this
    output is `UnsafeRecord` (the cache then runs the chain again), never reported as this output's release."""
    from flows.stages import ReleasedOutput, ReleaseInputs, chain_current
    from merge_engine.release.built import BuiltOutput
    from merge_engine.release.folders import MODEL
    from merge_engine.release.publish import Release
    from merge_engine.release.state import release_state
    from merge_engine.validate import ValidationReport
    from tasks.records import SETTINGS_RECORDS

    checkpoint = CheckpointRecord(url=str(tmp_path / "run/global_step_1/actor"), layout="fsdp", fingerprint="f",
                                  files=(("model_world_size_1_rank_0.pt", 10, "v"),))
    step = StepRecord(run_root=str(tmp_path / "run"), step=1, role="actor", url=checkpoint.url, status="complete",
                      layout="fsdp", fingerprint="s")
    release = str(tmp_path / "releases/actor/global_step_1")
    inputs = ReleaseInputs(kind=MODEL, step=step, checkpoint=checkpoint, release=release, staging_root=None,
                           settings={name: SETTINGS_RECORDS[name]() for name in ("merge", "validation", "execution")},
                           options={})
    output = BuiltOutput(kind=MODEL, source_url=checkpoint.url, url=release, fingerprint="a" * 64, release=release,
                         released=True)
    good = ReleasedOutput(output, ValidationReport(release), Release(release, checkpoint.url, "a" * 64, "1", 1, 1,
                                                                     "now", "attempt"))
    parameters = {"inputs": inputs, "timer": None, "state": release_state(release)}
    assert chain_current(good, parameters) is False  # of this output; nothing released there (yet)
    forged_record = {
        "other_release": lambda: dataclasses.replace(good, release=dataclasses.replace(good.release,
                                                                                       url=release + "-other")),
        "host_folder": lambda: dataclasses.replace(good, release=dataclasses.replace(good.release, url="/root/.ssh")),
        "other_source": lambda: dataclasses.replace(good, output=dataclasses.replace(
            output, source_url="s3://another-bucket/run/global_step_9/actor")),
        "other_kind": lambda: dataclasses.replace(good, output=dataclasses.replace(output, kind="adapter")),
        "other_fingerprint": lambda: dataclasses.replace(good, output=dataclasses.replace(output,
                                                                                          fingerprint="b" * 64)),
    }[forge]()
    with pytest.raises(UnsafeRecord) as error:
        chain_current(forged_record, parameters)
    assert error.value.path == forged_record.release.url


def test_plain_values_round_trip_and_only_as_their_own_type():
    for value in ("text", 3, 2.5, True):
        assert RECORD_SERIALIZER.loads(RECORD_SERIALIZER.dumps(value)) == value
    with pytest.raises(UnsafeRecord):
        RECORD_SERIALIZER.loads(json.dumps({"format": 1, "type": "int", "data": "3"}).encode())


@pytest.mark.parametrize(("fact", "forged_value"), [("lora", True), ("adapter_only", True),
                                                    ("parallel", {"world_size": 1, "fsdp_version": 2}),
                                                    ("layout", "megatron_legacy")])
def test_a_cached_check_stating_another_fact_is_refused_before_a_byte_is_built(fact, forged_value, prefect,
                                                                              template_run, tmp_path):
    """A well-formed check record at the step's key, its places and listing the step's own, one fact changed:
    the build checks the step again, finds the files say otherwise (`ForgedRecord`, an `UnsafeRecord`, naming the
    checkpoint) and builds nothing from it: the step is checked again, that check replaces the record at its key,
    and the release holds the step's own weights (a forged "LoRA" releases no adapter)."""
    import tasks.checked
    from flows.merge_step import merge_step
    from flows.params import MergeStepParams
    from merge_engine.layouts import check_checkpoint

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    step, key = _check_key(run_root)
    good = CheckpointRecord.from_checkpoint(check_checkpoint(step.url, None, step.listing()))
    assert getattr(good, fact) != forged_value
    _plant(prefect.results / key, {"format": 1, "type": "CheckpointRecord",
                                   "data": {**good.model_dump(mode="json"), fact: forged_value}})
    from tests.release_checks import assert_release_weights_equal

    refused = []
    real = tasks.checked._check_again

    def check_again(record, step, backend):
        try:
            return real(record, step, backend)
        except UnsafeRecord as exc:
            refused.append(exc)
            raise

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks.checked, "_check_again", check_again)
        outcome = merge_step(**MergeStepParams(run_root=run_root, step=1, staging_root=str(tmp_path / "staging"))
                             .flow_parameters())
    assert refused and fact in refused[0].message and refused[0].path == good.url
    (release,) = outcome.releases
    assert_release_weights_equal(release.url, template_run.reference_weights(1))
    stored = json.loads(json.loads((prefect.results / key).read_text())["result"])
    assert stored["data"][fact] == getattr(good, fact)  # the forged record replaced by the step's check


# --- records bound to what they name ------------------------------------------------------------------


def test_a_cached_check_naming_a_checkpoint_nested_in_the_step_publishes_the_steps_own_weights(prefect, template_run,
                                                                                              tmp_path):
    """verl's ``actor/huggingface/`` holding weights (here another step's) is a complete Hugging Face checkpoint
    inside the step. A check record of it planted at the step's check key names places and files inside the step,
    so `CheckpointRecord.verified_for` takes it; the build checks the STEP again (never the record's URL), finds
    another checkpoint and does not use the record: the release holds the step's own weights (before: the nested
    checkpoint's weights were published as the step's release)."""
    import shutil

    from flows.merge_step import merge_step
    from flows.params import MergeStepParams
    from merge_engine.layouts import check_checkpoint
    from tests.release_checks import assert_release_weights_equal

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    nested = tmp_path / "run" / "global_step_1" / "actor" / "huggingface"
    shutil.copyfile(template_run.references / "global_step_2" / "hf" / "model.safetensors",
                    nested / "model.safetensors")
    step, key = _check_key(run_root)
    inner = CheckpointRecord.from_checkpoint(check_checkpoint(str(nested)))
    assert inner.url.startswith(step.url + "/") and inner.verified_for(step) is inner  # inside the step
    _plant(prefect.results / key, {"format": 1, "type": "CheckpointRecord", "data": inner.model_dump(mode="json")})

    outcome = merge_step(**MergeStepParams(run_root=run_root, step=1,
                                           staging_root=str(tmp_path / "staging")).flow_parameters())
    (release,) = outcome.releases
    assert_release_weights_equal(release.url, template_run.reference_weights(1))


@pytest.mark.parametrize("planted", ["another_type", "another_place"])
def test_a_refused_check_record_is_skipped_and_never_blocks_its_step(planted, prefect, template_run, tmp_path):
    """A record at the step's check key that is of another type (before: `AttributeError` in the flow) or names
    another place (before: `UnsafeRecord` on this run and on every later one) is refused by name, logged and
    not used: the step is checked again under the key's next generation, published, and the next run is served
    from that check."""
    from flows.merge_step import merge_step
    from flows.params import MergeStepParams

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    step, key = _check_key(run_root)
    document = {"another_type": {"format": 1, "type": "str", "data": "not a check"},
                "another_place": {"format": 1, "type": "CheckpointRecord",
                                  "data": {"url": "/etc", "layout": "hf", "fingerprint": "f", "files": []}}}[planted]
    _plant(prefect.results / key, document)

    params = MergeStepParams(run_root=run_root, step=1, staging_root=str(tmp_path / "staging")).flow_parameters()
    assert merge_step(**params).status == "published"
    assert json.loads((prefect.results / key).read_text())["result"] == json.dumps(document)  # left as it was
    again = merge_step(**params)
    assert again.status == "already_published"
    assert [s.state for s in again.stages if s.name == "check"] == ["Cached"]
    from tasks.check import check_current

    with pytest.raises(UnsafeRecord):  # named, whatever the planted type
        check_current(RECORD_SERIALIZER.loads(json.dumps(document).encode()), {"step": step})


def test_a_stored_release_record_of_another_type_is_refused_by_name(tmp_path):
    """A chain's stored record that is not a `ReleasedOutput` (before: `AttributeError`) is `UnsafeRecord`."""
    from flows.stages import ReleaseInputs, chain_current
    from merge_engine.release.folders import MODEL
    from tasks.records import SETTINGS_RECORDS

    checkpoint = CheckpointRecord(url=str(tmp_path / "run/global_step_1/actor"), layout="fsdp", fingerprint="f",
                                  files=(("model_world_size_1_rank_0.pt", 10, "v"),))
    step = StepRecord(run_root=str(tmp_path / "run"), step=1, role="actor", url=checkpoint.url, status="complete",
                      layout="fsdp", fingerprint="s")
    inputs = ReleaseInputs(kind=MODEL, step=step, checkpoint=checkpoint, release=str(tmp_path / "release"),
                           staging_root=None, options={},
                           settings={name: SETTINGS_RECORDS[name]() for name in ("merge", "validation", "execution")})
    for other in (checkpoint, "text", None):
        with pytest.raises(UnsafeRecord, match="expected"):
            chain_current(other, {"inputs": inputs, "state": None})


def _chain_key(run_root: str, params: dict, checkpoint: CheckpointRecord) -> str:
    """The generation-0 key of the model chain of step 1 that `merge_step` with ``params`` computes."""
    from flows.params import MergeStepParams
    from flows.stages import CHAIN_KEY, CHAIN_LISTED, ReleaseInputs
    from merge_engine.release.folders import MODEL, release_url

    flow_params = MergeStepParams(**params)
    step = StepRecord.from_step(discover_step(run_root, 1, "actor"))
    inputs = ReleaseInputs(kind=MODEL, step=step, checkpoint=checkpoint,
                           release=release_url(flow_params.release_root_url, "actor", 1, MODEL),
                           settings=flow_params.settings(), staging_root=flow_params.staging_root,
                           options=flow_params.recorded_options(), overwrite=flow_params.overwrite)
    return stage_key("release", {"inputs": inputs}, CHAIN_KEY, CHAIN_LISTED)


def test_a_chain_record_copied_from_an_older_release_does_not_make_other_settings_a_cache_hit(prefect, template_run,
                                                                                             tmp_path):
    """Step 1 released as stored (fp32); its chain record (fingerprint and attempt of that release) copied to the
    key of a ``dtype=bf16, overwrite=true`` run: the release's manifest records another build than the run asks
    (`ForgedRecord`, logged), the chain runs and the release is bf16 (before: a cache hit, the release stayed
    fp32)."""
    import torch

    from flows.merge_step import merge_step
    from flows.params import MergeStepParams
    from tests.release_checks import release_tensors

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    as_stored = MergeStepParams(run_root=run_root, step=1, staging_root=str(tmp_path / "staging")).flow_parameters()
    (first,) = merge_step(**as_stored).releases
    assert {t.dtype for t in release_tensors(first.url).values()} == {torch.float32}
    _, check_key = _check_key(run_root)
    checked = RECORD_SERIALIZER.loads(json.loads((prefect.results / check_key).read_text())["result"].encode())
    old_chain = prefect.results / _chain_key(run_root, as_stored, checked)
    assert json.loads(json.loads(old_chain.read_text())["result"])["type"] == "ReleasedOutput"

    bf16 = {**as_stored, "dtype": "bf16", "overwrite": True}
    (prefect.results / _chain_key(run_root, bf16, checked)).write_bytes(old_chain.read_bytes())
    (release,) = merge_step(**bf16).releases
    assert not release.cached
    assert {t.dtype for t in release_tensors(release.url).values()} == {torch.bfloat16}
