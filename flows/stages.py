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
`merge_engine.validate.ValidationReport`, `merge_engine.release.publish.Release`).

One output, one task, one record: a chain runs as ONE cached task (`release_chain`: "model-release",
"adapter-release"), its stages nested task runs that are not cached and persist nothing. Its key holds
everything the output depends on (`CHAIN_KEY`: the step's listing, the checked checkpoint, the release, the
build's and the validation's settings; `CHAIN_LISTED`: the content of the config, base, reference and fused
model folders); its record is a `ReleasedOutput`, the only result kept per output. Two runs of one output
share one lock (the second waits, then takes the first's record: Cached, nothing run twice). A re-run is
one cache hit per output, no stage run. A record whose release is gone, damaged or published again since
(`chain_current`), or that is not of this output at all (a forged record: `UnsafeRecord`, logged), is not
used: the key moves to a new generation and the chain runs again (`tasks.cache`); with the cache lost but the
release in place, its stages find the release and read no checkpoint byte. `release_output` reads the
release's state ONCE and gives it to every stage (publishing reads it afresh only when it has something to
write); "cached" and "published nothing" are the chain's own state.

Not there (an error): the run root holds no files (`RunRootNotFound`) or none for this step and
role (`StepNotFound`). Not ready (an error only when no watcher will come back for it,
`flows.watchers`): the listing says incomplete; or the deep check finds a file incomplete or unreadable AND the step's listing changes meanwhile (checked
again after `SETTLE_S`): its files are still being written (a shared disk shows a rank file while
it grows). A file that is broken and stays as it is fails the check, once.

Each release's manifest records its `merge_engine.release.provenance.ReleaseProvenance`, ``checkpoint_lora``
among it (the checkpoint holds LoRA factors): the one answer to "does this step have an adapter"
that the watcher reads back.
"""

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from prefect import task

import merge_engine
from flows.outcomes import ReleaseOutcome, StageRun, StepOutcome
from merge_engine.commands.input_folders import InputFolders
from merge_engine.errors import CorruptShard, ForgedRecord, IncompleteCheckpoint, StepNotFound, UnsafeRecord
from merge_engine.layouts.runs import portable_record
from merge_engine.release.built import BuiltOutput
from merge_engine.release.publish import Release
from merge_engine.release.folders import ADAPTER, MODEL
from merge_engine.release.provenance import ReleaseProvenance
from merge_engine.release.state import ReleaseState, differing_options, release_state, state_of
from merge_engine.validate import ValidationReport
from tasks.build import BuildSpec, extract_adapter, merge_model
from tasks.cache import stage_cache_policy
from tasks.check import check_step
from tasks.discover import discover_step, discover_steps
from tasks.publish import publish_release, release_current
from tasks.records import (
    BuildSettings, CheckpointRecord, ExecutionSettings, StageSettings, StepRecord, ValidationSettings, of_type,
)
from tasks.result_records import RECORD_SERIALIZER, register_result_type
from tasks.results import configured_result_storage
from tasks.validate import validate_adapter, validate_output

SETTLE_S = float(os.environ.get("STEPMERGE_SETTLE_S", "3"))  # pause before listing a failed step again
logger = logging.getLogger(__name__)


class StageTimer:
    """Runs stage tasks and keeps a `StageRun` for each call.

    Applies the configured result storage (`tasks.results.configured_result_storage`: a guarded block, local by
    default, S3/GCS or a saved block with ``STEPMERGE_RESULT_STORAGE``) to every task it runs. Made at a flow's
    start: storage that cannot be guarded is `UnguardedResultStorage` before any task runs.
    """

    def __init__(self, label: str = "") -> None:
        self.stages: List[StageRun] = []
        self.result_storage = configured_result_storage()
        self.label = label  # appended to each task run's name (`flows.run_labels.step_label`)
        self._named: set = set()  # task names already given to a task run of this timer

    def call(self, name: str, task: Any, *args: Any, **kwargs: Any) -> Tuple[Any, StageRun]:
        """The task's result and its `StageRun` (recorded also when the task fails, then raised)."""
        task = task.with_options(result_storage=self.result_storage)
        if self.label:
            # a task run again in the same run (discover-step, then discover-again) is named by its stage
            # the second time: two task runs of one flow run never share a name
            shown = name if task.name in self._named else task.name
            self._named.add(task.name)
            task = task.with_options(task_run_name=f"{shown} {self.label}")
        started, position = time.perf_counter(), len(self.stages)
        state = task(*args, return_state=True, **kwargs)
        run = StageRun(name=name, state=state.name, seconds=round(time.perf_counter() - started, 3))
        self.stages.insert(position, run)  # before the stages nested in it (a chain's), which recorded first
        return state.result(), run

    def run(self, name: str, task: Any, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, task, *args, **kwargs)[0]


@dataclass(frozen=True)
class ReadyCheckpoint:
    """A step found and checked (``checkpoint`` set), or why it is not ready yet (``reason``)."""

    step: StepRecord
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
    # a cached check is not trusted blindly (`tasks.check.check_current` refused most forged ones already)
    return ReadyCheckpoint(found, of_type(checked, CheckpointRecord, found.url).verified_for(found))


@dataclass(frozen=True)
class ReleaseInputs:
    """What one output's chain starts from: the checked step, where it is released and how.

    ``settings`` holds every settings record of the flow (`flows.params.FlowParams.settings`: record name ->
    record); each stage takes the ones it reads (the build the record of its kind: `build`), so a
    stage reading a new record needs no new field here nor in the flows."""

    kind: str  # MODEL | ADAPTER
    step: StepRecord
    checkpoint: CheckpointRecord
    release: str
    settings: StageSettings
    staging_root: Optional[str]
    options: dict  # the options the flow records in the manifest
    overwrite: bool = False
    fused_model_url: Optional[str] = None  # adapters: the model release PEFT's logits must reproduce

    @property
    def build(self) -> BuildSettings:
        """The build's settings: the merge record for a model, the adapter record for an adapter."""
        return self.settings["merge"] if self.kind == MODEL else self.settings["adapter"]

    @property
    def validation(self) -> ValidationSettings:
        return self.settings["validation"]

    @property
    def execution(self) -> ExecutionSettings:
        """Where the shard jobs run (threads here, or Ray)."""
        return self.settings["execution"]

    def trained_model_arguments(self) -> Tuple[CheckpointRecord, Optional[float], Optional[str]]:
        """(checkpoint, lora_alpha, config_url) of the trained-model check: the checkpoint PEFT's model is
        rebuilt from, with the alpha and the config the build got (`merge_engine.validate.trained`)."""
        return (self.checkpoint, self.build.lora_alpha, self.build.hf_model_path)

    def provenance(self) -> ReleaseProvenance:
        return ReleaseProvenance(kind=self.kind, source_listing=self.step.fingerprint,
                                 checkpoint_fingerprint=self.checkpoint.fingerprint,
                                 checkpoint_lora=self.checkpoint.lora, settings=self.options)


    def build_spec(self) -> BuildSpec:
        return BuildSpec(self.kind, self.step, self.checkpoint, self.build)


@dataclass(frozen=True)
class ReleasedOutput:
    """What one output's chain did: its build, validation and release. The one result record kept per output."""

    output: BuiltOutput
    validation: ValidationReport
    release: Release


register_result_type(ReleasedOutput)


def model_chain(timer: StageTimer, inputs: ReleaseInputs, state: ReleaseState,
                folders: Optional[InputFolders] = None) -> ReleasedOutput:
    """merge -> validate -> publish: the merged model of ``inputs.checkpoint`` at ``inputs.release``."""
    output = timer.run("merge", merge_model, inputs.build_spec(), inputs.release, inputs.staging_root,
                       inputs.overwrite, inputs.execution, state, folders)
    report = timer.run("validate", validate_output, output, inputs.validation, inputs.release,
                       *inputs.trained_model_arguments(), state, inputs.step)
    released = timer.run("publish", publish_release, output, report, inputs.release,
                         inputs.provenance().to_manifest_options(), inputs.overwrite, state)
    return ReleasedOutput(output, report, released)


def adapter_chain(timer: StageTimer, inputs: ReleaseInputs, state: ReleaseState,
                  folders: Optional[InputFolders] = None) -> ReleasedOutput:
    """extract-adapter -> validate-adapter -> publish-adapter: the PEFT adapter of ``inputs.checkpoint``."""
    output = timer.run("extract-adapter", extract_adapter, inputs.build_spec(), inputs.release, inputs.staging_root,
                       inputs.overwrite, inputs.execution, state, folders)
    report = timer.run("validate-adapter", validate_adapter, output, inputs.validation, inputs.fused_model_url,
                       inputs.release, *inputs.trained_model_arguments(), state, inputs.step)
    released = timer.run("publish-adapter", publish_release, output, report, inputs.release,
                         inputs.provenance().to_manifest_options(), inputs.overwrite, state)
    return ReleasedOutput(output, report, released)


CHAINS = {MODEL: model_chain, ADAPTER: adapter_chain}
# what the output depends on: the step's listing, the checked checkpoint, where and how it is built and validated
CHAIN_KEY = ("inputs.kind", "inputs.step.fingerprint", "inputs.checkpoint", "inputs.release", "inputs.build",
             "inputs.validation", "inputs.fused_model_url")
# the folders whose content it depends on: a replacement config, a base model, a reference, the fused model
CHAIN_LISTED = ("inputs.build.hf_model_path", "inputs.build.base_model", "inputs.validation.reference_url",
                "inputs.fused_model_url")


def chain_current(record: ReleasedOutput, parameters: Dict[str, Any]) -> bool:
    """Is a stored chain record still the release (`tasks.publish.release_current`), and the release this run's
    settings build? The result store is another party's to write: a record of another type is `UnsafeRecord`; one
    that is not of this output (another release, kind or checkpoint) is `UnsafeRecord`; one naming a release
    whose manifest records another build (`release_built_as_asked`: another checkpoint, other settings, another
    engine, e.g. an older fp32 release's fingerprint and attempt copied into the key of a bf16 run) is
    `ForgedRecord`. Each is logged and not used: the chain runs again (`tasks.cache.live_generation`)."""
    inputs: ReleaseInputs = parameters["inputs"]
    of_type(record, ReleasedOutput, inputs.release)
    if (record.release.url, record.output.kind, record.output.source_url, record.release.fingerprint) \
            != (inputs.release, inputs.kind, inputs.checkpoint.url, record.output.fingerprint):
        raise UnsafeRecord(f"a stored release record of {record.output.source_url} at {record.release.url} is not "
                           f"the {inputs.kind} of {inputs.checkpoint.url} at {inputs.release}", record.release.url)
    if not release_current(record.release, parameters):
        return False
    given = parameters.get("state")
    state = state_of(inputs.release, given)
    if not state.is_current(record.release.fingerprint, record.release.attempt):
        state = release_state(inputs.release)  # published by another run since the flow read it
    differ = release_built_as_asked(state, inputs)
    if differ:
        raise ForgedRecord(f"a stored release record names the release at {inputs.release}, whose manifest records "
                           f"another build than this run asks ({'; '.join(differ)})", record.release.url)
    return True


def release_built_as_asked(state: ReleaseState, inputs: ReleaseInputs) -> List[str]:
    """What the release's manifest records other than this run's build of ``inputs`` would (empty: none): its
    kind, its checkpoint's fingerprint, each recorded setting (`differing_options`: sizes compared in bytes) and
    the engine version. The build's fingerprint covers all of these, so a release built from this run's inputs
    always agrees."""
    manifest = state.manifest
    if manifest is None:
        return ["no manifest"]
    released, asked = manifest.provenance, inputs.provenance()
    differ = [f"{name}: {a!r} there, {b!r} asked" for name, a, b in
              (("kind", released.kind, asked.kind),
               ("checkpoint", released.checkpoint_fingerprint, asked.checkpoint_fingerprint),
               ("engine", manifest.engine_version, merge_engine.__version__)) if a != b]
    # as `publish` records them: JSON, with this machine's paths by their portable names
    settings = portable_record(json.loads(json.dumps(dict(asked.settings), sort_keys=True, default=str)))
    differ += [f"{name}: {a!r} there, {b!r} asked" for name, a, b in differing_options(released.settings, settings)]
    return differ


@task(name="release-output",
      cache_policy=stage_cache_policy("release", CHAIN_KEY, still_valid=chain_current, listed=CHAIN_LISTED),
      persist_result=True, result_serializer=RECORD_SERIALIZER)
def release_chain(inputs: ReleaseInputs, timer: StageTimer, state: ReleaseState,
                  folders: InputFolders) -> ReleasedOutput:
    """The chain of ``inputs.kind`` (`CHAINS`), its stages run as nested task runs recorded by ``timer``; the build
    reads the input folders by ``folders``, the listings its cache key took of them (`tasks.cache`: a fresh
    `InputFolders` from the caller, filled by the key, read here)."""
    return CHAINS[inputs.kind](timer, inputs, state, folders)


CHAIN_TASKS = {MODEL: release_chain.with_options(name="model-release"),
               ADAPTER: release_chain.with_options(name="adapter-release")}


def release_output(timer: StageTimer, kind: str, step: StepRecord, checkpoint: CheckpointRecord, release: str, *,
                   settings: StageSettings, staging_root: Optional[str], options: dict,
                   overwrite: bool = False, fused_model_url: Optional[str] = None,
                   backend: Optional[str] = None) -> ReleaseOutcome:
    """Build, validate and publish one output of ``checkpoint`` at ``release`` (the chain of ``kind``), with
    the flow's settings records (``settings``: `ReleaseInputs.settings`); `release_checked` without the check."""
    return release_checked(timer, kind, step, checkpoint, release, settings=settings, staging_root=staging_root,
                           options=options, overwrite=overwrite, fused_model_url=fused_model_url,
                           backend=backend)[0]


def release_checked(timer: StageTimer, kind: str, step: StepRecord, checkpoint: CheckpointRecord, release: str, *,
                    settings: StageSettings, staging_root: Optional[str], options: dict,
                    overwrite: bool = False, fused_model_url: Optional[str] = None,
                    backend: Optional[str] = None) -> Tuple[ReleaseOutcome, CheckpointRecord]:
    """`release_output`, and the check of ``step`` it was built from: ``checkpoint``, or this run's check when a
    cached ``checkpoint`` was found forged (the flow's next output is then built from that one).

    The release's state is read once, here: every stage is given it (publishing reads it again only
    when it has something to write). A cached ``checkpoint`` that the build finds forged (`ForgedRecord`: the
    step's files say otherwise, `tasks.checked`) is logged and not used: the step is checked again (``backend``:
    the one its check task was given), that check replaces the record at its key (`check_again`), and the chain
    runs from it."""
    task = CHAIN_TASKS[kind]

    def chain_of(checked: CheckpointRecord) -> Tuple[ReleasedOutput, StageRun]:
        inputs = ReleaseInputs(kind=kind, step=step, checkpoint=checked, release=release, settings=settings,
                               staging_root=staging_root, options=options, overwrite=overwrite,
                               fused_model_url=fused_model_url)
        return timer.call(task.name, task, inputs, timer, release_state(release), InputFolders())

    try:
        chain, run = chain_of(checkpoint)
    except ForgedRecord as exc:
        if checkpoint.index is not None:
            raise  # this run's own check: nothing stored to compute again
        checkpoint = check_again(timer, step, backend, exc)
        chain, run = chain_of(checkpoint)
    output, report, released = chain.output, chain.validation, chain.release
    return ReleaseOutcome(kind=kind, url=released.url, fingerprint=released.fingerprint,
                          # the chain a cache hit: this run published nothing
                          already_published=released.already_published or output.released or run.cached,
                          cached=run.cached, validation_ok=report.ok,
                          validation_summary=released_summary(report, released.url), tensors=output.tensors,
                          tensor_bytes=output.tensor_bytes, files=released.files,
                          total_bytes=released.total_bytes), checkpoint


def check_again(timer: StageTimer, step: StepRecord, backend: Optional[str], refused: Exception) -> CheckpointRecord:
    """This run's check of ``step``, replacing the stored check record that was ``refused`` (logged): the check task
    run with ``refresh_cache``, so its result is written at the key the refused record held."""
    logger.warning("%s; the step is checked again", refused)
    checked = timer.run("check-again", check_step.with_options(refresh_cache=True), step, backend)
    return of_type(checked, CheckpointRecord, step.url).verified_for(step)


def checked_lora(timer: StageTimer, step: StepRecord, checkpoint: CheckpointRecord,
                 backend: Optional[str] = None) -> CheckpointRecord:
    """``checkpoint`` when its ``lora`` fact may refuse an adapter release without a build: this run's own check, or
    a cached one saying LoRA (the adapter's build checks it again). A cached one saying "no LoRA" is checked again
    here (`tasks.checked`), so a forged "no" cannot block a step's adapter; forged, it is replaced
    (`check_again`)."""
    from tasks.checked import checked_checkpoint

    if checkpoint.index is not None or checkpoint.lora:
        return checkpoint
    try:
        checked_checkpoint(checkpoint, step, backend)
    except ForgedRecord as exc:
        return check_again(timer, step, backend, exc)
    return checkpoint


def released_summary(report: ValidationReport, release_url: str) -> str:
    """The validation summary naming the RELEASE (validation ran on the staging copy, removed after the
    publish, whose bytes the publish checked against the shard jobs' sha256 while copying)."""
    if not report.model_url or report.model_url == release_url:
        return report.summary()
    return replace(report, model_url=release_url).summary()


__all__ = ["StageRun", "ReleaseOutcome", "StepOutcome", "StageTimer", "ReadyCheckpoint", "ready_checkpoint",
           "ReleaseInputs", "ReleasedOutput", "model_chain", "adapter_chain", "release_chain", "release_output",
           "release_checked", "check_again", "checked_lora",
           "MODEL", "ADAPTER"]
