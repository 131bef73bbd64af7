"""Flow ``merge-step``: one step of a run -> a validated, published Hugging Face release (+ adapter).

    discover-step   (one listing of the step's folder, never the run root)
                                   -> is the step there (else Failed: `RunRootNotFound`, `StepNotFound`)
                                      and complete? If not: "not ready", nothing done
    check-checkpoint               -> deep completeness check, cached on the listing fingerprint (a file
                                      found truncated while the step's files still change: "not ready")
    "not ready" ends Completed only when a watcher will merge the step later, in a state named
    ``NotReady`` with the tag ``not-ready`` (`flows.run_labels.ended`), and the artifact names the
    watcher; otherwise the run fails saying so (`flows.watchers`). No green run that did nothing.
    model:   merge           -> validate         -> publish          (`flows.stages.model_chain`)
    adapter: extract-adapter -> validate-adapter -> publish-adapter  (LoRA checkpoints only)
    each output's chain one cached task (model-release, adapter-release), its stages nested in it
    push / push-adapter  -> with ``hub_repo``: each release to its own revision of the Hub repo
                            (`flows.hub_stage`); a failed push fails the run there, the release stays published
    register / register-adapter -> with ``mlflow_model``: each release becomes a version in MLflow's Model
                            Registry, by reference (`flows.registry_stage`); a failure is recorded the same way

The merged model of a LoRA checkpoint is the trained model (adapters fused, as the engine defines
it); with ``release_adapter`` its PEFT adapter is released beside it, validated against that model.
Both are also validated against the TRAINED model, PEFT's own model of the run rebuilt from the
checkpoint (`merge_engine.validate.trained`): a release that is not the trained model is not published.
Whatever layout the step has (FSDP, Megatron, Hugging Face weights), the tasks are the same.

A re-run of a published step is a cache hit per output: one listing, a few marker/manifest reads, no
weight byte. A markdown artifact summarises the run (tensors, bytes, time, validation); the merge task
moves a progress artifact while it writes. Named errors (corrupt shard, failed validation) fail
the run without retries and publish nothing.

Parameters are flat and typed (`flows.params`: ``step`` and ``run_root`` first); the run is named
``<run> <role> step <N>`` and tagged ``run:``, ``role:``, ``step:`` (`flows.run_labels`).
"""

import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.credentials import storage_credentials
from flows.hub_stage import hub_target, push_releases, raise_failed_push
from flows.params import (
    AS_STORED, Alpha, BaseModelId, BaseModelUrl, Dtype, HfModelPath, IncludeBase, MaxShardSize, MergeStepParams,
    Overwrite, RayCluster, ReferenceUrl, ReleaseAdapter, ReleaseRoot, Role, RunRoot, StagingRoot, Step,
    ValidateForward, WeightsFormat, Workers,
    DEFAULT_HUB_REVISION, HubMovingRef, HubPrivate, HubRepo, HubRevision, HubTokenSecret,
    MlflowModel, MlflowTrackingUri,
)
from flows.registry_stage import register_releases, registry_target
from flows.run_labels import ended, label_flow_run, step_label, step_run_name
from flows.stages import StageTimer, StepOutcome, ready_checkpoint, release_checked, release_output
from flows.summaries import step_summary
from flows.watchers import not_ready_error, retrying_watcher
from merge_engine.option_values import DEFAULT_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT
from merge_engine.release.folders import ADAPTER, MODEL, release_url
from tasks.progress import artifact_key
from tasks.result_records import RECORD_SERIALIZER


def summary_key(params: MergeStepParams) -> str:
    import hashlib

    digest = hashlib.sha256(params.run_root.encode()).hexdigest()[:8]
    return artifact_key("merge", params.role or "sft", "step", params.step, digest)


def run_stages(params: MergeStepParams, timer: StageTimer) -> StepOutcome:
    """The body of merge_step (see the module docstring); raises the failing stage's error."""
    started = time.perf_counter()
    outcome = StepOutcome(run_root=params.run_root, step=params.step, role=params.role, status="not_ready")
    settings = params.settings()
    ready = ready_checkpoint(timer, params.run_root, params.step, params.role, settings["merge"].backend)
    if ready.checkpoint is None:
        watcher = retrying_watcher(params.run_root)
        if watcher is None:
            raise not_ready_error(params.run_root, params.step, params.role, ready.reason,
                                  ready.step.url)
        outcome.reason = f"{ready.reason}; {watcher} merges it once it is complete"
        outcome.stages = timer.stages
        outcome.seconds = time.perf_counter() - started
        return outcome
    step, checkpoint = ready.step, ready.checkpoint
    options, backend = params.recorded_options(), settings["merge"].backend
    root = params.release_root_url
    # the model's build may have found a cached check forged: the adapter is decided by, and built from, its check
    model, checkpoint = release_checked(timer, MODEL, step, checkpoint,
                                        release_url(root, params.role, params.step, MODEL), settings=settings,
                                        staging_root=params.staging_root, options=options,
                                        overwrite=params.overwrite, backend=backend)
    releases = [model]
    if checkpoint.lora and params.release_adapter:
        adapter_release = release_url(root, params.role, params.step, ADAPTER)
        adapter = release_output(timer, ADAPTER, step, checkpoint, adapter_release, fused_model_url=model.url,
                                 settings=settings, staging_root=params.staging_root, options=options,
                                 overwrite=params.overwrite, backend=backend)
        releases.append(adapter)
    outcome.releases = releases
    outcome.status = "already_published" if all(r.already_published for r in releases) else "published"
    outcome.stages = timer.stages
    outcome.seconds = time.perf_counter() - started
    return outcome


@flow(name="merge-step", flow_run_name=step_run_name, log_prints=True, persist_result=True,
      result_serializer=RECORD_SERIALIZER)
def merge_step(step: Step, run_root: RunRoot, role: Role = "actor", release_root: ReleaseRoot = "",
               dtype: Dtype = AS_STORED, max_shard_size: MaxShardSize = DEFAULT_SHARD_SIZE,
               hf_model_path: HfModelPath = "", weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT,
               validate_forward: ValidateForward = True, reference_url: ReferenceUrl = "",
               release_adapter: ReleaseAdapter = True, include_base: IncludeBase = True, lora_alpha: Alpha = 0,
               base_model: BaseModelUrl = "", base_model_id: BaseModelId = "", overwrite: Overwrite = False,
               staging_root: StagingRoot = "", workers: Workers = 0, ray_address: RayCluster = "", hub_repo: HubRepo = "",
               hub_revision: HubRevision = DEFAULT_HUB_REVISION, hub_moving_ref: HubMovingRef = "",
               hub_private: HubPrivate = False, hub_token_secret: HubTokenSecret = "",
               mlflow_model: MlflowModel = "", mlflow_tracking_uri: MlflowTrackingUri = "") -> StepOutcome:
    """Merge, validate and publish one step of a training run (see the module docstring; each parameter's text:
    its type in `flows.params`)."""
    params = MergeStepParams(**locals())
    logger = get_run_logger()
    label_flow_run(params.run_root, params.role, params.step)
    timer = StageTimer(label=step_label(params.step, params.role))
    try:
        with storage_credentials():
            outcome = run_stages(params, timer)
            push_error = push_releases(timer, outcome, hub_target(params))  # after publish: never the release's
            registry_error = register_releases(timer, outcome, registry_target(params))  # after publish, too
            outcome.stages = timer.stages
    except Exception as exc:
        failed = StepOutcome(run_root=params.run_root, step=params.step, role=params.role, status="failed",
                             stages=timer.stages)
        create_markdown_artifact(step_summary(failed, error=f"{type(exc).__name__}: {exc}"),
                                 key=summary_key(params), description=f"merge of step {params.step} failed")
        raise
    create_markdown_artifact(step_summary(outcome), key=summary_key(params),
                             description=f"merge of step {params.step}: {outcome.status}")
    for release in outcome.releases:
        logger.info("%s release %s (%s; validation %s)", release.kind, release.url,
                    "cache hit" if release.cached else ("already published" if release.already_published
                                                        else "published"),
                    {True: "passed", False: "FAILED", None: "not run"}[release.validation_ok])
    if outcome.status == "not_ready":
        logger.info("step %s (%s) is not ready: %s", params.step, params.role or "sft", outcome.reason)
    raise_failed_push(push_error or registry_error)  # the release stays published; the run fails at that stage
    return ended(outcome)  # a not-ready step: the state NotReady, tag not-ready


if __name__ == "__main__":
    import sys

    print(merge_step(run_root=sys.argv[1], step=int(sys.argv[2])))
