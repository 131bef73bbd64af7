"""Flow ``release-adapter``: extract a step's LoRA adapter to PEFT, validate it, publish it.

    discover-step -> check-checkpoint -> extract-adapter -> validate-adapter -> publish-adapter
    -> push-adapter (with ``hub_repo``: `flows.hub_stage`; the adapter's revision ends in ``-adapter``)
    -> register-adapter (with ``mlflow_model``: `flows.registry_stage`; a version of ``<mlflow_model>-adapter``)

The adapter release (`merge_engine.release.folders.release_url` with ``kind=ADAPTER``) holds
``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's names; r, target_modules and
rank_pattern from the tensors, lora_alpha from the run's metadata, never guessed) and, with
``include_base``, the clean base model under ``base/``. Validation loads base + adapter with PEFT;
when the step's merged model is already released (merge_step) FROM THIS CHECKPOINT (its manifest's
provenance: this checkpoint's fingerprint, the same lora_alpha and no replaced config,
`ReleaseProvenance.is_trained_model_of`), the logits must
reproduce it; a model release of anything else there is no reference and is not used. Whatever the
model release, PEFT(base + adapter) must reproduce the trained model, PEFT's own model of the run rebuilt
from the checkpoint (`merge_engine.validate.trained`; reported skipped for a LoRA-only checkpoint or a
model over the worker's memory budget). LoRA-only
checkpoints need ``base_model``. ``workers`` / ``ray_address``: where the extraction's shard jobs run,
as for `merge_step` (``STEPMERGE_RAY_ADDRESS`` in the worker's environment, e.g. a deployment job
variable, when ``ray_address`` is not given); never recorded in the release (same bytes).
A step not ready yet is reported as such (`flows.stages.ready_checkpoint`). `merge_step` runs the same stages for LoRA checkpoints; this flow
is for adapters alone (e.g. from the UI, or for a LoRA-only run).
"""

import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.credentials import storage_credentials
from flows.hub_stage import hub_target, push_releases, raise_failed_push
from flows.params import (
    AS_STORED, AdapterParams, Alpha, BaseModelId, BaseModelUrl, CompareWithModelRelease, Dtype, IncludeBase,
    Overwrite, RayCluster, ReleaseRoot, Role, RunRoot, StagingRoot, Step, ValidateForward, Workers,
    DEFAULT_HUB_REVISION, HubMovingRef, HubPrivate, HubRepo, HubRevision, HubTokenSecret,
    MlflowModel, MlflowTrackingUri,
)
from flows.registry_stage import register_releases, registry_target
from flows.run_labels import adapter_run_name, ended, label_flow_run, step_label
from flows.stages import StageTimer, StepOutcome, checked_lora, ready_checkpoint, release_output
from flows.summaries import step_summary
from flows.watchers import not_ready_error, retrying_watcher
from merge_engine.errors import AdapterError
from merge_engine.release.folders import ADAPTER, MODEL, release_url
from merge_engine.release.state import release_state
from tasks.progress import release_artifact_key
from tasks.records import CheckpointRecord
from tasks.result_records import RECORD_SERIALIZER


def model_release_of(url: str, checkpoint: CheckpointRecord, params: AdapterParams) -> bool:
    """Is the model release at ``url`` whole and the trained model of this very checkpoint, fused with
    the alpha this adapter gets and the checkpoint's own config (so PEFT's logits must reproduce it)?"""
    state = release_state(url)
    provenance = state.provenance
    return state.intact and provenance is not None and provenance.is_trained_model_of(checkpoint.fingerprint,
                                                                                      params.lora_alpha)


@flow(name="release-adapter", flow_run_name=adapter_run_name, log_prints=True, persist_result=True,
      result_serializer=RECORD_SERIALIZER)
def release_adapter(step: Step, run_root: RunRoot, role: Role = "actor", release_root: ReleaseRoot = "",
                    include_base: IncludeBase = True, dtype: Dtype = AS_STORED, validate_forward: ValidateForward = True,
                    compare_with_model_release: CompareWithModelRelease = True, lora_alpha: Alpha = 0,
                    base_model: BaseModelUrl = "", base_model_id: BaseModelId = "", overwrite: Overwrite = False,
                    staging_root: StagingRoot = "", workers: Workers = 0, ray_address: RayCluster = "", hub_repo: HubRepo = "",
                    hub_revision: HubRevision = DEFAULT_HUB_REVISION, hub_moving_ref: HubMovingRef = "",
                    hub_private: HubPrivate = False, hub_token_secret: HubTokenSecret = "",
                    mlflow_model: MlflowModel = "", mlflow_tracking_uri: MlflowTrackingUri = "") -> StepOutcome:
    """Extract, validate and publish the LoRA adapter of one step (see the module docstring; each parameter's text:
    its type in `flows.params`)."""
    params = AdapterParams(**locals())
    label_flow_run(params.run_root, params.role, params.step)
    with storage_credentials():
        return ended(adapter_stages(params))  # a not-ready step: the state NotReady, tag not-ready


def adapter_stages(params: AdapterParams) -> StepOutcome:
    """The body of `release_adapter` (inside a flow run)."""
    started = time.perf_counter()
    timer = StageTimer(label=step_label(params.step, params.role))
    outcome = StepOutcome(run_root=params.run_root, step=params.step, role=params.role, status="not_ready")
    ready = ready_checkpoint(timer, params.run_root, params.step, params.role)
    if ready.checkpoint is None:
        watcher = retrying_watcher(params.run_root)
        if watcher is None:
            raise not_ready_error(params.run_root, params.step, params.role, ready.reason,
                                  ready.step.url)
        outcome.reason = f"{ready.reason}; {watcher} releases its adapter once it is complete"
        outcome.stages, outcome.seconds = timer.stages, time.perf_counter() - started
        return outcome
    step, checkpoint = ready.step, ready.checkpoint
    checkpoint = checked_lora(timer, step, checkpoint)  # a cached "no LoRA" is checked before it refuses
    if not checkpoint.lora:
        raise AdapterError("this checkpoint holds no LoRA factors (lora_A/lora_B): nothing to extract", step.url)
    root = params.release_root_url
    release = release_url(root, params.role, params.step, ADAPTER)
    fused = release_url(root, params.role, params.step, MODEL)
    fused_url = fused if params.compare_with_model_release and model_release_of(fused, checkpoint, params) else None
    adapter = release_output(timer, ADAPTER, step, checkpoint, release, settings=params.settings(),
                             staging_root=params.staging_root, options=params.recorded_options(),
                             overwrite=params.overwrite, fused_model_url=fused_url)
    outcome.releases = [adapter]
    outcome.status = "already_published" if adapter.already_published else "published"
    push_error = push_releases(timer, outcome, hub_target(params))  # after publish: never the release's
    registry_error = register_releases(timer, outcome, registry_target(params))  # after publish, too
    outcome.stages, outcome.seconds = timer.stages, time.perf_counter() - started
    create_markdown_artifact(step_summary(outcome), key=release_artifact_key("adapter", release),
                             description=f"adapter of step {params.step}: {outcome.status}")
    raise_failed_push(push_error or registry_error)  # the release stays published; the run fails at that stage
    return outcome
