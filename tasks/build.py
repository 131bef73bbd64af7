"""The build task: one output of a checked checkpoint (its merged model, or its LoRA adapter) -> staging.

`build_output` is the one body; `merge_model` and `extract_adapter` are its two names in the UI (the
same task, the same cache policy and retries). What it builds is a `BuildSpec`: the kind of output
(`MODEL`: `merge_engine.commands.merge.MergeJob`; `ADAPTER`: `merge_engine.commands.extract.ExtractJob`),
the checked checkpoint and its settings.

- Cache key: the step's listing fingerprint, the checkpoint record, the settings (and the listings of
  ``hf_model_path`` and ``base_model``: their content, not their name, shapes the output), the release
  it is for, the engine version (`tasks.cache`). Same key -> Prefect returns the record, nothing is
  read; unless the output it describes is gone (`ReleaseState.output_available`: neither in staging
  nor released), then the next cache generation is used and the build runs again.
- Not in the cache but already released: when the release holds the engine's fingerprint of this very
  build (`merge_fingerprint` / `extract_fingerprint`), nothing is built; the output names the release
  (``released=True``). The release is the truth, the cache an accelerator.
- A release built from something else (the step was rewritten since, or other options) without
  ``overwrite``: `TargetExists` at once, before a byte is read or staged (publishing would refuse it
  anyway, after the whole build).
- Otherwise the engine's job writes the staging folder (atomically; a finished staging folder of the
  same build is reused), with a progress artifact moving as bytes are written, from the checkpoint the
  check task checked: in this run, as it is; served from the cache, checked again first (once per run), every
  fact the record states compared with the files (`tasks.checked`: a forged record fails, named). An adapter's
  config names the base as it will be published (``<release>/base``), written so by the job. Staging folders left by crashed runs are swept
  first (`merge_engine.release.staging.sweep_stale_staging`).
- ``state``: the release's state as the flow read it at the chain's start (`flows.stages`): the cache
  check and the build ask it instead of reading the release again (None: read here, once).
- Where the shard jobs run (``execution``, never part of the cache key: it changes no byte): Prefect
  task runs on a Ray cluster when a Ray address is configured (the flow's ``ray_address``, else
  ``STEPMERGE_RAY_ADDRESS`` in the worker's environment; `tasks.shard_runs.task_executor_address`), else
  ``workers`` threads here (None: one per core). The output carries the shard jobs' sha256 of every weight file and index
  (``checksums``): publishing checks the bytes it copies against them.
- Retries: transient storage faults only; named errors (corrupt shard, ...) fail at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from prefect import task

from merge_engine.output.executors import executor_at
from merge_engine.output.jobs import OutputJob, run_job
from merge_engine.release.built import BuiltOutput
from merge_engine.versions import require_tested_versions
from merge_engine.release.folders import ADAPTER, MODEL
from merge_engine.release.state import ReleaseState, release_state, state_of
from merge_engine.release.staging import staging_url, sweep_stale_staging
from tasks.cache import stage_cache_policy
from tasks.checked import checked_checkpoint
from tasks.progress import ProgressArtifact, release_artifact_key
from tasks.records import SETTINGS_RECORDS, CheckpointRecord, Settings
from tasks.result_records import RECORD_SERIALIZER
from tasks.retry import RETRY_OPTIONS
from tasks.shard_runs import task_executor_address

# the settings a release records that a build of other options would differ in (`ReleaseState.refuse_other`)
RECORDED_SETTINGS = {"dtype", "max_shard_size", "hf_model_path", "lora_alpha", "weights_format"}


@dataclass(frozen=True)
class BuildSpec:
    """What one build writes: ``kind`` (MODEL | ADAPTER) of ``checkpoint`` with ``settings``, from the step
    whose listing fingerprint is ``source_listing`` (it also holds the run's LoRA metadata)."""

    kind: str
    source_listing: str
    checkpoint: CheckpointRecord
    settings: Settings  # the merge record (a model) or the adapter record (`tasks.records.SETTINGS_RECORDS`)


def output_available(output: BuiltOutput, inputs: dict[str, Any]) -> bool:
    """Is a cached output still somewhere: its staging folder, or its release (`ReleaseState.output_available`)?
    Asks the state the flow gave the task; a "no" from it is asked again of the release as it is now (a
    concurrent run of the step may have published it since the flow read it)."""
    given = inputs.get("state")
    state = state_of(output.release_url, given)
    if state.output_available(output):
        return True
    return state is given and release_state(output.release_url).output_available(output)


def verified_output(output: BuiltOutput, spec: BuildSpec, release: str, staging_root: Optional[str]) -> BuiltOutput:
    """``output`` when it can be the build of ``spec`` for ``release`` (a cached build comes from a result store
    another party may write): its kind and source are the spec's, and its bytes are where this build puts them
    (the release itself when found released, else the staging folder of its fingerprint). Else `UnsafeRecord`
    naming the output's URL: a forged record cannot make publishing copy another place into the release."""
    from merge_engine.errors import UnsafeRecord

    where = release if output.released else staging_url(staging_root, release, output.fingerprint)
    if output.kind != spec.kind or output.source_url != spec.checkpoint.url or output.url != where \
            or output.release_url != release:
        raise UnsafeRecord(f"a built output of {output.source_url} at {output.url} is not where the build of "
                           f"{spec.checkpoint.url} for {release} puts its bytes ({where})", output.url)
    return output


def output_job(spec: BuildSpec, release: str) -> OutputJob:
    """The engine's `OutputJob` writing ``spec``, to be published at ``release`` (staging is ours to replace:
    ``overwrite``); its target is set once its fingerprint names the staging folder (`build_output`). The
    record is turned into the engine's checkpoint once, here (`checked_checkpoint`)."""
    options = spec.settings.to_options(overwrite=True)
    checkpoint = checked_checkpoint(spec.checkpoint, options.backend)
    if spec.kind == MODEL:
        from merge_engine.commands.merge import MergeJob

        return MergeJob(checkpoint.url, "", options, checkpoint)
    from merge_engine.commands.extract import ExtractJob

    return ExtractJob(checkpoint.url, "", options, checkpoint, published_url=release)


def progress_title(spec: BuildSpec, release: str) -> str:
    if spec.kind == MODEL:
        return f"Merging {spec.checkpoint.url} -> {release}"
    return f"Extracting the adapter of {spec.checkpoint.url}"


@task(name="build-output",
      cache_policy=stage_cache_policy("build", ("spec", "release"), still_valid=output_available,
                                      listed=("spec.settings.hf_model_path", "spec.settings.base_model")),
      persist_result=True, result_serializer=RECORD_SERIALIZER, **RETRY_OPTIONS)
def build_output(spec: BuildSpec, release: str, staging_root: Optional[str] = None, overwrite: bool = False,
                 execution: Optional[Settings] = None, state: Optional[ReleaseState] = None) -> BuiltOutput:
    """Build ``spec`` into a staging folder for ``release`` (or find it already released there)."""
    job = output_job(spec, release)
    fingerprint = job.fingerprint()  # metadata only (listings and small JSON files); once per build
    found = state_of(release, state).released_output(spec.kind, spec.checkpoint.url, fingerprint, overwrite=overwrite,
                                  checkpoint_fingerprint=spec.checkpoint.fingerprint,
                                  settings=spec.settings.model_dump(include=RECORDED_SETTINGS))
    if found is not None:
        return found
    require_tested_versions()  # a worker with an untested transformers / peft fails here, in one line, not retried
    job.target_url = target = staging_url(staging_root, release, fingerprint)
    sweep_stale_staging(staging_root, keep=target)
    progress = ProgressArtifact(release_artifact_key("progress", release), progress_title(spec, release))
    execution = execution or SETTINGS_RECORDS["execution"]()
    executor = executor_at(task_executor_address(execution.workers, execution.ray_address))
    result = run_job(job, on_bytes=progress.on_bytes, on_plan=progress.on_plan,
                     executor=executor)
    progress.finish()
    return BuiltOutput.from_result(spec.kind, result, release)


merge_model = build_output.with_options(name="merge-model")
extract_adapter = build_output.with_options(name="extract-adapter")
