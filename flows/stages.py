"""The stage chains shared by the flows: find the step, build, validate, publish; each stage timed.

`StageTimer.call` runs a task with ``return_state=True`` and records its state name ("Completed",
"Cached", "Failed") and wall time as a `StageRun`, then returns the result (raising the task's
exception when it failed). `ready_checkpoint` finds a step (a listing of its own folder only) and
checks it, or says why it is not ready yet (the one rule for merge_step and release_adapter).

Each kind of output has its chain, plain code that reads top to bottom (`model_chain`,
`adapter_chain`): three stage tasks, each fed by the ones before it::

    model:   merge            -> BuiltOutput       (staging, or "already released": nothing read)
             validate         -> ValidationReport  (a LoRA checkpoint's output is also compared with
                                                    the trained model PEFT rebuilds from it)
             publish          -> Release           (manifest and _COMPLETE marker)
    adapter: extract-adapter  -> BuiltOutput
             validate-adapter -> ValidationReport
             publish-adapter  -> Release

Records crossing a stage are the engine's own (`merge_engine.release.built.BuiltOutput`,
`merge_engine.validate.ValidationReport`, `merge_engine.release.publish.Release`). `release_output`
reads the release's state ONCE and gives it to every stage (a stage asks it instead of reading the
release again; publishing reads it afresh only when it has something to write), runs the chain and
tells from its OWN stages' states whether it was all cache hits and whether this run published
anything: a stage added to a chain counts, wherever it is.

Plain task calls: a re-run is all cache hits. A cached result whose output is gone (the release was
deleted or damaged since) is not trusted: the tasks' cache policy moves to a new cache generation
and the stage runs again (`tasks.cache`); with the cache lost but the release in place, the tasks
find the release and read nothing.

Not there (an error): the run root holds no files (`RunRootNotFound`) or none for this step and
role (`StepNotFound`). Not ready (an error only when no watcher will come back for it,
`flows.watchers`): the listing says incomplete; or the deep check finds a file incomplete or unreadable AND the step's listing changes meanwhile (checked
again after `SETTLE_S`): its files are still being written (a shared disk shows a rank file while
it grows). A file that is broken and stays as it is fails the check, once.

Each release's manifest records its `merge_engine.release.provenance.ReleaseProvenance`, ``checkpoint_lora``
among it (the checkpoint holds LoRA factors): the one answer to "does this step have an adapter"
that the watcher reads back.
"""

import os
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from flows.outcomes import ReleaseOutcome, StageRun, StepOutcome
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, StepNotFound
from merge_engine.release.built import BuiltOutput
from merge_engine.release.publish import Release
from merge_engine.release.folders import ADAPTER, MODEL
from merge_engine.release.provenance import ReleaseProvenance
from merge_engine.release.state import ReleaseState, release_state
from merge_engine.validate import ValidationReport
from tasks.build import BuildSpec, extract_adapter, merge_model, verified_output
from tasks.check import check_step
from tasks.discover import discover_step, discover_steps
from tasks.publish import publish_release
from tasks.records import CheckpointRecord, Settings, StepRecord
from tasks.results import configured_result_storage
from tasks.validate import validate_adapter, validate_output

BUILD_SETTINGS = {MODEL: "merge", ADAPTER: "adapter"}  # the settings record each kind's build reads
SETTLE_S = float(os.environ.get("STEPMERGE_SETTLE_S", "3"))  # pause before listing a failed step again


class StageTimer:
    """Runs stage tasks and keeps a `StageRun` for each call.

    Applies the configured result storage (`tasks.results.configured_result_storage`: local by
    default, S3/GCS with ``STEPMERGE_RESULT_STORAGE``) to every task it runs.
    """

    def __init__(self, label: str = "") -> None:
        self.stages: List[StageRun] = []
        self.result_storage = configured_result_storage()
        self.label = label  # appended to each task run's name (`flows.run_labels.step_label`)
        self._named: set = set()  # task names already given to a task run of this timer

    def call(self, name: str, task: Any, *args: Any, **kwargs: Any) -> Tuple[Any, StageRun]:
        """The task's result and its `StageRun` (recorded also when the task fails, then raised)."""
        if self.result_storage is not None:
            task = task.with_options(result_storage=self.result_storage)
        if self.label:
            # a task run again in the same run (discover-step, then discover-again) is named by its stage
            # the second time: two task runs of one flow run never share a name
            shown = name if task.name in self._named else task.name
            self._named.add(task.name)
            task = task.with_options(task_run_name=f"{shown} {self.label}")
        started = time.perf_counter()
        state = task(*args, return_state=True, **kwargs)
        run = StageRun(name=name, state=state.name, seconds=round(time.perf_counter() - started, 3))
        self.stages.append(run)
        return state.result(), run

    def run(self, name: str, task: Any, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, task, *args, **kwargs)[0]


@dataclass(frozen=True)
class ReadyCheckpoint:
    """A step found and checked (``checkpoint`` set), or why it is not ready yet (``reason``)."""

    step: Optional[StepRecord]
    checkpoint: Optional[CheckpointRecord]
    reason: str = ""


def ready_checkpoint(timer: StageTimer, run_root: str, step: int, role: str,
                     backend: Optional[str] = None) -> ReadyCheckpoint:
    """Discover and deep-check one step (see the module docstring for "not ready").

    Raises `RunRootNotFound` when the run root holds no files, `StepNotFound` (listing the steps
    there) when it holds none for this step and role, and the check's error when the step is broken
    and its files are not changing.
    """
    # the listing alone: the check reads what a layout's second look would (`discover_step`'s ``look_again``)
    found = timer.run("discover", discover_step, run_root, step, role, False)
    if found is None:
        # Not there: only now is the whole run root listed, to say why (no files at all: RunRootNotFound); the
        # steps' names are all the error needs (``roles=()``: no step's marker is read)
        discovery = timer.run("discover-run-root", discover_steps, run_root, ())
        there = [f"{s.step} ({s.role or 'sft'})" for s in discovery.steps]
        listed = ", ".join(there[-10:]) if there else "none"
        raise StepNotFound(f"no checkpoint for step {step} ({role or 'sft'}) under this run root (steps there: "
                           f"{'..., ' if len(there) > 10 else ''}{listed})", run_root)
    if found.status == "incomplete":  # "not yet", never an error; "invalid" fails in the check
        return ReadyCheckpoint(found, None, found.reason or "incomplete")
    try:
        checked = timer.run("check", check_step, found, backend)
    except (IncompleteCheckpoint, CorruptShard) as exc:
        time.sleep(SETTLE_S)
        again = timer.run("discover-again", discover_step, run_root, step, role, False)
        if again is None or again.fingerprint != found.fingerprint:
            return ReadyCheckpoint(found, None, f"its files are still being written (they changed while being "
                                                f"checked; the check said: {exc.message})")
        raise
    return ReadyCheckpoint(found, checked.verified_for(found))  # a cached check is not trusted blindly


@dataclass(frozen=True)
class ReleaseInputs:
    """What one output's chain starts from: the checked step, where it is released and how.

    ``settings`` holds every settings record of the flow (`flows.params.FlowParams.settings`: record name ->
    record); each stage takes the ones it reads (the build the record of its kind, `BUILD_SETTINGS`), so a
    stage reading a new record needs no new field here nor in the flows."""

    kind: str  # MODEL | ADAPTER
    step: StepRecord
    checkpoint: CheckpointRecord
    release: str
    settings: Dict[str, Settings]
    staging_root: Optional[str]
    options: dict  # the options the flow records in the manifest
    overwrite: bool = False
    fused_model_url: Optional[str] = None  # adapters: the model release PEFT's logits must reproduce

    @property
    def build(self) -> Settings:
        """The build's settings: the merge record for a model, the adapter record for an adapter."""
        return self.settings[BUILD_SETTINGS[self.kind]]

    @property
    def validation(self) -> Settings:
        return self.settings["validation"]

    @property
    def execution(self) -> Settings:
        """Where the shard jobs run (threads here, or Ray)."""
        return self.settings["execution"]

    def trained_model_arguments(self) -> tuple:
        """(checkpoint, lora_alpha, config_url) of the trained-model check: the checkpoint PEFT's model is
        rebuilt from, with the alpha and the config the build got (`merge_engine.validate.trained`)."""
        return (self.checkpoint, getattr(self.build, "lora_alpha", None), getattr(self.build, "hf_model_path", None))

    def provenance(self) -> ReleaseProvenance:
        return ReleaseProvenance(kind=self.kind, source_listing=self.step.fingerprint,
                                 checkpoint_fingerprint=self.checkpoint.fingerprint,
                                 checkpoint_lora=self.checkpoint.lora, settings=self.options)


    def build_spec(self) -> BuildSpec:
        return BuildSpec(self.kind, self.step.fingerprint, self.checkpoint, self.build)


@dataclass(frozen=True)
class ChainRun:
    """What a chain did: its three results, the `StageRun` of each stage it ran, in order, and its publish's
    (a publish that was a cache hit published nothing this run, whatever stages follow it)."""

    output: BuiltOutput
    validation: ValidationReport
    release: Release
    runs: Tuple[StageRun, ...]
    published: StageRun

    @property
    def cached(self) -> bool:
        """Every stage of the chain was a cache hit (whatever the chain's length)."""
        return all(run.cached for run in self.runs)


def model_chain(timer: StageTimer, inputs: ReleaseInputs, state: ReleaseState) -> ChainRun:
    """merge -> validate -> publish: the merged model of ``inputs.checkpoint`` at ``inputs.release``."""
    first = len(timer.stages)
    output = verified_output(timer.run("merge", merge_model, inputs.build_spec(), inputs.release,
                                       inputs.staging_root, inputs.overwrite, inputs.execution, state),
                             inputs.build_spec(), inputs.release, inputs.staging_root)
    report = timer.run("validate", validate_output, output, inputs.validation, inputs.release,
                       *inputs.trained_model_arguments(), state)
    released, published = timer.call("publish", publish_release, output, report, inputs.release,
                                     inputs.provenance().to_manifest_options(), inputs.overwrite, state)
    return ChainRun(output, report, released, tuple(timer.stages[first:]), published)


def adapter_chain(timer: StageTimer, inputs: ReleaseInputs, state: ReleaseState) -> ChainRun:
    """extract-adapter -> validate-adapter -> publish-adapter: the PEFT adapter of ``inputs.checkpoint``."""
    first = len(timer.stages)
    output = verified_output(timer.run("extract-adapter", extract_adapter, inputs.build_spec(), inputs.release,
                                       inputs.staging_root, inputs.overwrite, inputs.execution, state),
                             inputs.build_spec(), inputs.release, inputs.staging_root)
    report = timer.run("validate-adapter", validate_adapter, output, inputs.validation, inputs.fused_model_url,
                       inputs.release, *inputs.trained_model_arguments(), state)
    released, published = timer.call("publish-adapter", publish_release, output, report, inputs.release,
                                     inputs.provenance().to_manifest_options(), inputs.overwrite, state)
    return ChainRun(output, report, released, tuple(timer.stages[first:]), published)


def release_output(timer: StageTimer, kind: str, step: StepRecord, checkpoint: CheckpointRecord, release: str, *,
                   settings: Dict[str, Settings], staging_root: Optional[str], options: dict,
                   overwrite: bool = False, fused_model_url: Optional[str] = None) -> ReleaseOutcome:
    """Build, validate and publish one output of ``checkpoint`` at ``release`` (the chain of ``kind``), with
    the flow's settings records (``settings``: `ReleaseInputs.settings`).

    The release's state is read once, here: every stage is given it (publishing reads it again only
    when it has something to write)."""
    inputs = ReleaseInputs(kind=kind, step=step, checkpoint=checkpoint, release=release, settings=settings,
                           staging_root=staging_root, options=options, overwrite=overwrite,
                           fused_model_url=fused_model_url)
    chain = (model_chain if kind == MODEL else adapter_chain)(timer, inputs, release_state(release))
    output, report, released = chain.output, chain.validation, chain.release
    return ReleaseOutcome(kind=kind, url=released.url, fingerprint=released.fingerprint,
                          # publish a cache hit: this run published nothing
                          already_published=(released.already_published or output.released
                                             or chain.published.cached),
                          cached=chain.cached, validation_ok=report.ok,
                          validation_summary=released_summary(report, released.url), tensors=output.tensors,
                          tensor_bytes=output.tensor_bytes, files=released.files, total_bytes=released.total_bytes)


def released_summary(report: ValidationReport, release_url: str) -> str:
    """The validation summary naming the RELEASE (validation ran on the staging copy, removed after the
    publish, whose bytes the publish checked against the shard jobs' sha256 while copying)."""
    if not report.model_url or report.model_url == release_url:
        return report.summary()
    return replace(report, model_url=release_url).summary()


__all__ = ["StageRun", "ReleaseOutcome", "StepOutcome", "StageTimer", "ReadyCheckpoint", "ready_checkpoint",
           "ReleaseInputs", "ChainRun", "model_chain", "adapter_chain", "release_output", "MODEL", "ADAPTER"]
