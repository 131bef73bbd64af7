"""The build task: one output of a checked checkpoint (its merged model, or its LoRA adapter) -> staging.

`build_output` is the one body; `merge_model` and `extract_adapter` are its two names in the UI (the
same task, the same retries). What it builds is a `BuildSpec`: the kind of output
(`MODEL`: `merge_engine.commands.merge.MergeJob`; `ADAPTER`: `merge_engine.commands.extract.ExtractJob`),
the checked checkpoint and its settings.

- Not cached itself, and it persists nothing: the output's chain is the task cached (`flows.stages`: one result
  record per output); the build is its first nested stage.
- Already released: when the release holds the engine's fingerprint of this very
  build (`merge_fingerprint` / `extract_fingerprint`), nothing is built; the output names the release
  (``released=True``): the chain's cache was lost, the release is the truth.
- A release built from something else (the step was rewritten since, or other options) without
  ``overwrite``: `TargetExists` at once, before a byte is read or staged (publishing would refuse it
  anyway, after the whole build).
- Otherwise the engine's job writes the staging folder (atomically), with a progress artifact moving as bytes
  are written, from the checkpoint the check task checked: in this run, as it is; served from the cache,
  checked again first (once per run), every fact the record states compared with the files (`tasks.checked`:
  a forged record fails, named). An adapter's config names the base as it will be published
  (``<release>/base``), written so by the job. Staging folders left by crashed runs are swept first
  (`merge_engine.release.staging.sweep_stale_staging`).
- A finished staging folder of the same build (an earlier run's publish failed) is reused, with the sha256 its
  shard jobs computed, kept beside it: publishing checks the staged bytes against them. A folder without them
  is written again (`merge_engine.release.staging`).
- ``state``: the release's state as the flow read it at the chain's start (`flows.stages`): the build asks it
  instead of reading the release again (None: read here, once). ``folders``: the listings of the input
  folders the chain's cache key took (the chain task's ``folders``, `tasks.cache`): the job reads by them, so the
  release's fingerprint and its cache key are of the same files (None: the job lists them itself).
- Where the shard jobs run (``execution``, never part of a cache key: it changes no byte): Prefect
  task runs on a Ray cluster when a Ray address is configured (the flow's ``ray_address``, else
  ``STEPMERGE_RAY_ADDRESS`` in the worker's environment; `tasks.shard_runs.task_executor_address`), else
  ``workers`` threads here (None: one per core). The output carries the shard jobs' sha256 of every weight
  file and index (``checksums``): publishing checks the bytes it copies against them.
- Retries: transient storage faults only; named errors (corrupt shard, ...) fail at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from merge_engine.commands.input_folders import InputFolders
from merge_engine.layouts.runs import portable_record
from merge_engine import storage
from merge_engine.output.jobs import OutputJob, OutputResult, run_job
from merge_engine.release.built import BuiltOutput
from merge_engine.versions import require_tested_versions
from merge_engine.release.folders import ADAPTER, MODEL
from merge_engine.release.state import ReleaseState, state_of
from merge_engine.release.staging import keep_checksums, kept_checksums, staging_url, sweep_stale_staging
from tasks.checked import checked_checkpoint
from tasks.progress import ProgressArtifact, release_artifact_key
from tasks.records import BuildSettings, CheckpointRecord, ExecutionSettings, StepRecord
from tasks.retry import RETRY_OPTIONS
from tasks.shard_runs import task_executor


@dataclass(frozen=True)
class BuildSpec:
    """What one build writes: ``kind`` (MODEL | ADAPTER) of ``checkpoint``, the check of ``step`` (whose listing
    also holds the run's LoRA metadata), with ``settings``."""

    kind: str
    step: StepRecord
    checkpoint: CheckpointRecord
    settings: BuildSettings  # the merge record (a model) or the adapter record (`tasks.records.SETTINGS_RECORDS`)

    @property
    def source_listing(self) -> str:
        """The fingerprint of the step's listing."""
        return self.step.fingerprint


def output_job(spec: BuildSpec, release: str, folders: Optional[InputFolders] = None) -> OutputJob:
    """The engine's `OutputJob` writing ``spec``, to be published at ``release`` (staging is ours to replace:
    ``overwrite``); its target is set once its fingerprint names the staging folder (`build_output`). The
    record is turned into the engine's checkpoint once, here (`checked_checkpoint`: a cached one checked again as the
    check of the spec's step). ``folders``: the listings
    of its input folders the chain's cache key took (the job reads by them instead of listing again)."""
    options = spec.settings.to_options(overwrite=True)
    checkpoint = checked_checkpoint(spec.checkpoint, spec.step, options.backend)
    if spec.kind == MODEL:
        from merge_engine.commands.merge import MergeJob

        model = MergeJob(checkpoint.url, "", options, checkpoint)
        if folders is not None:
            model.inputs = folders
        return model
    from merge_engine.commands.extract import ExtractJob

    adapter = ExtractJob(checkpoint.url, "", options, checkpoint)
    if folders is not None:
        adapter.inputs = folders
    return adapter


def progress_title(spec: BuildSpec, release: str) -> str:
    if spec.kind == MODEL:
        return f"Merging {spec.checkpoint.url} -> {release}"
    return f"Extracting the adapter of {spec.checkpoint.url}"


@task(name="build-output", cache_policy=NO_CACHE, persist_result=False, **RETRY_OPTIONS)
def build_output(spec: BuildSpec, release: str, staging_root: Optional[str] = None, overwrite: bool = False,
                 execution: Optional[ExecutionSettings] = None, state: Optional[ReleaseState] = None,
                 folders: Optional[InputFolders] = None) -> BuiltOutput:
    """Build ``spec`` into a staging folder for ``release`` (or find it already released there)."""
    job = output_job(spec, release, folders)
    fingerprint = job.fingerprint()  # metadata only (listings and small JSON files); once per build
    found = state_of(release, state).released_output(spec.kind, spec.checkpoint.url, fingerprint, overwrite=overwrite,
                                  checkpoint_fingerprint=spec.checkpoint.fingerprint,
                                  settings=portable_record(spec.settings.recorded_values()))
    if found is not None:
        return found
    require_tested_versions()  # a worker with an untested transformers / peft fails here, in one line, not retried
    job.target_url = target = staging_url(staging_root, release, fingerprint)
    sweep_stale_staging(staging_root, keep=target)
    progress = ProgressArtifact(release_artifact_key("progress", release), progress_title(spec, release))
    execution = execution or ExecutionSettings()
    executor = task_executor(execution.workers, execution.ray_address)

    def build() -> OutputResult:
        return run_job(job, on_bytes=progress.on_bytes, on_plan=progress.on_plan, executor=executor)

    result = build()
    if result.skipped:  # a finished staging folder of this build, left by a run whose publish failed
        kept = kept_checksums(target, fingerprint)
        if kept is None:  # publishing could not check its bytes against what was written: write them again
            storage.remove(target, recursive=True)
            result = build()
        else:
            result = replace(result, checksums=kept)
    if not result.skipped:
        keep_checksums(target, fingerprint, result.checksums)
    progress.finish()
    return BuiltOutput.from_result(spec.kind, result, release)


merge_model = build_output.with_options(name="merge-model")
extract_adapter = build_output.with_options(name="extract-adapter")
