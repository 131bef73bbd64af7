"""The stage chain shared by the flows: find the step, build, validate, publish; each stage timed.

`StageTimer.run` calls a task with ``return_state=True`` and records its state name ("Completed",
"Cached", "Failed") and wall time, then returns the result (raising the task's exception when it
failed). `ready_checkpoint` finds a step and checks it, or says why it is not ready yet (the one
rule for merge_step and release_adapter). `release_output` runs the chain for one output of a
step (the merged model, or the LoRA adapter):

    merge / extract  -> staging (or "already released": nothing read)
    validate         -> report
    publish          -> release with manifest and _COMPLETE marker

Plain task calls: a re-run is all cache hits. A cached result whose output is gone (the release was
deleted or damaged since) is not trusted: the tasks' cache policy moves to a new cache generation
and the stage runs again (`tasks.cache`); with the cache lost but the release in place, the tasks
find the release and read nothing.

Not ready (never an error): no files for the step and role yet; the listing says incomplete; or the
deep check finds a file incomplete or unreadable AND the step's listing changes meanwhile (checked
again after `SETTLE_S`): its files are still being written (a shared disk shows a rank file while
it grows). A file that is broken and stays as it is fails the check, once.

Each release's manifest records ``checkpoint_lora`` (the checkpoint holds LoRA factors): the one
answer to "does this step have an adapter" that the watcher reads back.
"""

import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional

from pydantic import BaseModel

from flows.step_keys import step_key
from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.release import ADAPTER, MODEL, ReleaseProvenance
from tasks.adapter import extract_adapter, validate_adapter
from tasks.check import check_step
from tasks.discover import discover_steps
from tasks.merge import merge_model
from tasks.publish import publish_release
from tasks.records import (
    AdapterSettings,
    CheckpointRecord,
    MergeSettings,
    StepRecord,
    ValidationSettings,
)
from tasks.results import configured_result_storage
from tasks.validate import validate_output

SETTLE_S = float(os.environ.get("STEPMERGE_SETTLE_S", "3"))  # pause before listing a failed step again


class StageRun(BaseModel):
    """One stage task call: its name, final state and wall time (Prefect overhead included)."""

    name: str
    state: str
    seconds: float


class ReleaseOutcome(BaseModel):
    """What one output of a step became."""

    kind: str
    url: str
    fingerprint: str
    already_published: bool
    cached: bool
    validation_ok: Optional[bool]
    validation_summary: str = ""
    tensors: int = 0
    tensor_bytes: int = 0
    files: int = 0
    total_bytes: int = 0


class StepOutcome(BaseModel):
    """What a merge_step run did: status, releases, and every stage with its state and time."""

    run_root: str
    step: int
    role: str
    status: str  # "published" | "already_published" | "not_ready"
    reason: str = ""
    releases: List[ReleaseOutcome] = []
    stages: List[StageRun] = []
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)

    @property
    def cached(self) -> bool:
        return bool(self.releases) and all(r.cached for r in self.releases)


class StageTimer:
    """Runs stage tasks and keeps a `StageRun` for each call.

    Applies the configured result storage (`tasks.results.configured_result_storage`: local by
    default, S3/GCS with ``STEPMERGE_RESULT_STORAGE``) to every task it runs.
    """

    def __init__(self) -> None:
        self.stages: List[StageRun] = []
        self.result_storage = configured_result_storage()

    def run(self, name: str, task: Any, *args: Any, **kwargs: Any) -> Any:
        if self.result_storage is not None:
            task = task.with_options(result_storage=self.result_storage)
        started = time.perf_counter()
        state = task(*args, return_state=True, **kwargs)
        self.stages.append(StageRun(name=name, state=state.name, seconds=round(time.perf_counter() - started, 3)))
        return state.result()


@dataclass(frozen=True)
class ReadyCheckpoint:
    """A step found and checked (``checkpoint`` set), or why it is not ready yet (``reason``)."""

    step: Optional[StepRecord]
    checkpoint: Optional[CheckpointRecord]
    reason: str = ""


def ready_checkpoint(timer: StageTimer, run_root: str, step: int, role: str,
                     backend: Optional[str] = None) -> ReadyCheckpoint:
    """Discover and deep-check one step (see the module docstring for "not ready").

    Raises the check's error when the step is broken and its files are not changing.
    """
    found = timer.run("discover", discover_steps, run_root).find(step, role)
    if found is None:
        return ReadyCheckpoint(None, None, "no checkpoint files for this step and role yet")
    if found.status == "incomplete":  # "not yet", never an error; "invalid" fails in the check
        return ReadyCheckpoint(found, None, found.reason or "incomplete")
    try:
        return ReadyCheckpoint(found, timer.run("check", check_step, found, backend))
    except (IncompleteCheckpoint, CorruptShard) as exc:
        time.sleep(SETTLE_S)
        again = timer.run("discover-again", discover_steps, run_root).find(step, role)
        if again is None or again.fingerprint != found.fingerprint:
            return ReadyCheckpoint(found, None, f"its files are still being written (they changed while being "
                                                f"checked; the check said: {exc.message})")
        raise


def release_output(timer: StageTimer, kind: str, step: StepRecord, checkpoint: CheckpointRecord, release: str, *,
                   merge: Optional[MergeSettings] = None, adapter: Optional[AdapterSettings] = None,
                   validation: ValidationSettings, staging_root: Optional[str], options: dict,
                   overwrite: bool = False, fused_model_url: Optional[str] = None) -> ReleaseOutcome:
    """Build, validate and publish one output of ``checkpoint`` at ``release``."""
    if kind == MODEL:
        output = timer.run("merge", merge_model, checkpoint, merge, release, staging_root, overwrite)
        report = timer.run("validate", validate_output, output, validation, release)
    else:
        output = timer.run("extract-adapter", extract_adapter, step, checkpoint, adapter, release, staging_root,
                           overwrite)
        report = timer.run("validate-adapter", validate_adapter, output, validation, fused_model_url, release)
    suffix = "" if kind == MODEL else "-adapter"
    provenance = ReleaseProvenance(kind=kind, source_listing=step.fingerprint,
                                   checkpoint_fingerprint=checkpoint.fingerprint, checkpoint_lora=checkpoint.lora,
                                   settings=options)
    published_options = provenance.to_manifest_options()
    released = timer.run(f"publish{suffix}", publish_release, output, report, release, published_options,
                         overwrite)
    cached = all(s.state == "Cached" for s in timer.stages[-3:])
    publish_cached = timer.stages[-1].state == "Cached"  # this run published nothing
    return ReleaseOutcome(kind=kind, url=released.url, fingerprint=released.fingerprint,
                          already_published=released.already_published or output.released or publish_cached,
                          cached=cached, validation_ok=report.ok,
                          validation_summary=report.summary, tensors=output.tensors,
                          tensor_bytes=output.tensor_bytes, files=released.files, total_bytes=released.total_bytes)


__all__ = ["StageRun", "ReleaseOutcome", "StepOutcome", "StageTimer", "ReadyCheckpoint", "ready_checkpoint",
           "release_output", "MODEL", "ADAPTER"]
