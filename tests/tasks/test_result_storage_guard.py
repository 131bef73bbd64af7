"""Every result store the stage tasks cache in reads only stepmerge's JSON records, whatever names it.

Specification:
- ``STEPMERGE_RESULT_STORAGE=<block-type>/<block-name>`` (a saved block) and Prefect's own
  ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` are used through a guarded copy of that block (same place): a pickle
  record planted at the check task's key in that block's store is never loaded (no marker, no child process);
  the check runs, its JSON record replaces the plant, and the next run is served from the cache;
- a stage task run outside stepmerge's flows (its own flow, Prefect's default local storage, unguarded) gets no
  cache key: it runs, and reads no record (a pickle planted at its key runs nothing);
- a saved block of a type that cannot be guarded is `UnguardedResultStorage` naming it when the flow starts,
  before any task runs.
"""

from __future__ import annotations

import json
import uuid

import pytest
from prefect import flow
from prefect.filesystems import LocalFileSystem
from prefect.settings import PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK, temporary_settings

from flows.stages import StageTimer, ready_checkpoint
from merge_engine.errors import UnguardedResultStorage
from merge_engine.layouts.discovery import discover_step
from tasks.cache import stage_key
from tasks.check import check_step
from tasks.records import CheckpointRecord, StepRecord
from tasks.results import GuardedS3Bucket, guarded_block
from tests.fixtures_pipeline import copy_steps
from tests.forged_pickles import INDEX_MODULE, PAYLOADS, Inert, forged
from tests.tasks.test_result_attacks import _record

GADGET, PROTOCOL, OPCODE = next(p for p in PAYLOADS if p[0].name == "os_system" and p[1:] == (5, "STACK_GLOBAL"))


class ShadowFileSystem(LocalFileSystem):
    """A block type stepmerge does not know (a subclass: its reads could be anything)."""

    _block_type_name = "Stepmerge Test Shadow File System"


@flow
def _checked(run_root: str) -> CheckpointRecord:
    return ready_checkpoint(StageTimer(), run_root, 1, "actor").checkpoint


def _step(template_run, tmp_path) -> tuple[str, StepRecord, str]:
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    step = StepRecord.from_step(discover_step(run_root, 1, "actor"))
    return run_root, step, stage_key("check", {"step": step, "backend": None}, ("step", "backend"))


def _plant_pickle(path, marker) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_record({"type": "pickle", "picklelib": "pickle"},
                             forged(GADGET, marker, PROTOCOL, OPCODE, INDEX_MODULE)))


def _counting_checks(monkeypatch) -> list:
    import tasks.check

    checks: list = []
    real = tasks.check.check_checkpoint
    monkeypatch.setattr(tasks.check, "check_checkpoint", lambda *a, **k: checks.append(a[0]) or real(*a, **k))
    return checks


@pytest.mark.parametrize("named_by", ["STEPMERGE_RESULT_STORAGE", "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"])
def test_a_pickle_planted_in_a_block_named_by_slug_is_never_loaded(named_by, prefect, template_run, tmp_path,
                                                                   monkeypatch):
    shared = tmp_path / "shared-cache"
    name = f"shared-{uuid.uuid4().hex[:8]}"
    LocalFileSystem(basepath=str(shared)).save(name, overwrite=True)
    slug = f"local-file-system/{name}"
    run_root, _, key = _step(template_run, tmp_path)
    marker = tmp_path / "pwned"
    _plant_pickle(shared / key, marker)
    checks = _counting_checks(monkeypatch)
    if named_by == "STEPMERGE_RESULT_STORAGE":
        monkeypatch.setenv("STEPMERGE_RESULT_STORAGE", slug)
        settings = temporary_settings(updates={})
    else:
        monkeypatch.delenv("STEPMERGE_RESULT_STORAGE", raising=False)
        settings = temporary_settings(updates={PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK: slug})
    with Inert(marker), settings:
        first = _checked(run_root)
        again = _checked(run_root)
    assert len(checks) == 1 and first.index is not None and again.index is None  # checked once, then cached
    # the JSON record replaced the plant, in the block's own place
    assert json.loads((shared / key).read_bytes())["metadata"]["serializer"] == {"type": "stepmerge-records"}


def test_a_stage_task_in_a_flow_of_its_own_reads_no_record(prefect, template_run, tmp_path, monkeypatch):
    _, step, key = _step(template_run, tmp_path)
    marker = tmp_path / "pwned"
    _plant_pickle(prefect.results / key, marker)  # Prefect's default (unguarded) local storage, at the task's key
    checks = _counting_checks(monkeypatch)

    @flow
    def own_flow() -> CheckpointRecord:
        return check_step(step)

    with Inert(marker):
        assert own_flow().index is not None and own_flow().index is not None
    assert len(checks) == 2  # no cache key: each run checks


def test_a_block_that_cannot_be_guarded_is_refused_at_the_flow_start(prefect, template_run, tmp_path, monkeypatch):
    name = f"shadow-{uuid.uuid4().hex[:8]}"
    ShadowFileSystem(basepath=str(tmp_path / "shadow")).save(name, overwrite=True)
    slug = f"stepmerge-test-shadow-file-system/{name}"
    monkeypatch.setenv("STEPMERGE_RESULT_STORAGE", slug)
    run_root, _, _ = _step(template_run, tmp_path)
    checks = _counting_checks(monkeypatch)
    with pytest.raises(UnguardedResultStorage) as error:
        _checked(run_root)
    assert error.value.path == slug and "ShadowFileSystem" in str(error.value)
    assert checks == []


def test_a_guarded_copy_keeps_the_blocks_place_and_settings():
    from prefect_aws import AwsCredentials, S3Bucket

    block = S3Bucket(bucket_name="b", bucket_folder="results", credentials=AwsCredentials(aws_access_key_id="k"))
    guarded = guarded_block(block, "s3-bucket/x")
    assert type(guarded) is GuardedS3Bucket and guarded.bucket_folder == "results"
    assert guarded.credentials.aws_access_key_id == "k" and guarded_block(guarded, "x") is guarded
