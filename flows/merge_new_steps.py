"""Flow ``merge-new-steps`` (the watcher, on an interval schedule): merge every step not yet released.

Each run computes, from two listings, COMPLETE STEPS MINUS PUBLISHED STEPS — no high-water mark, so
a step that completes late, or a lower step that appears after a higher one, is still merged; a
step whose release was deleted is merged again. Steps still being written are reported as "not
ready" and left for a later run.

A step is published when its model release is there and, if that release's manifest records that
the checkpoint holds LoRA factors (``checkpoint_lora``, decided by merge_step from the tensors) and
adapters are released, its adapter release too: one rule, the one merge_step follows, so a step is
never submitted again for a release merge_step would not make. (A model release from before that
record: the model alone.)

A step whose layout says its merge needs parameters it does not record (`StepRecord.needs`, from discovery's
second look: a verl Megatron LoRA step, told by verl's ``ckpt_contents.json``; a torch DCP step saved without a
config, as HF Trainer saves one) is merged only with them: ``base_model`` when its base
weights were not saved, ``lora_alpha`` when no PEFT export records it (``use_dist_checkpointing: true``, or
a missing bridge export), ``hf_model_path`` when a step holding its base saved no config. Without them the
step is not submitted (every merge would fail the same way), it is reported as "needs <parameter>", and the
run fails saying so, each run, until the parameters are given: no merge is attempted, nothing loops.

One merge per step:
- from a deployment (the watcher deployed on the ``cpu`` pool), each step is a run of the
  ``merge_deployment`` (``merge-step/gpu``) submitted with the idempotency key
  ``{run_root}:{role}:{step}`` and tagged with the step's listing (`flows.submission`): a merge
  still running is not started twice; a finished run is followed by another only by the rules
  there (release deleted since; files changed; failed: a few times, with growing pauses). A run
  that failed earlier is reported ("failed earlier", "given up"), and does not fail this run;
- in local mode (no deployment), each step is an in-process ``merge_step`` subflow, one after the other.
A step whose merge (local mode) or submission fails does not stop the others; the run fails at the
end if any step failed IN THIS RUN. A markdown artifact lists what happened to each step. A
release whose step was rewritten since (its listing differs from the one recorded in the manifest)
is reported, and re-merged only with ``overwrite``.
"""

import datetime as dt
import hashlib
import time
from typing import List, Optional

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import deployment
from pydantic import BaseModel

from flows.outcomes import StepOutcome
from flows.credentials import storage_credentials
from flows.params import (
    AS_STORED, DEFAULT_ROLES, Alpha, BaseModelId, BaseModelUrl, Dtype, HfModelPath, IncludeBase, MaxShardSize, MaxSteps,
    MergeDeployment, Overwrite, RayCluster, ReferenceUrl, ReleaseAdapter, ReleaseRoot, Roles, RunRoot, StagingRoot,
    ValidateForward, WatchParams, WeightsFormat, Workers,
    DEFAULT_HUB_REVISION, HubMovingRef, HubPrivate, HubRepo, HubRevision, HubTokenSecret,
    MlflowModel, MlflowTrackingUri,
)
from flows.run_labels import label_flow_run, run_tags, watch_run_name
from flows.step_keys import step_key
from flows.submission import SubmittedRun, submit_step_run
from flows.summaries import watch_summary
from merge_engine.option_values import DEFAULT_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT
from merge_engine.release.folders import ADAPTER, MODEL, release_folder_name
from tasks.discover import PublishedRelease, discover_steps, find_published
from tasks.progress import artifact_key
from tasks.records import StepRecord

SUBMITTED = {"submitted": "submitted", "resubmitted": "resubmitted", "running": "running",
             "completed": "already published", "waiting": "failed earlier", "gave up": "given up"}
LOCAL = {"published": "merged", "already_published": "already published", "not_ready": "not ready"}


class StepAction(BaseModel):
    step: int
    role: str
    # "merged" | "already published" | "not ready" | "failed" (this run) | "error" (could not submit) |
    # "submitted" | "resubmitted" | "running" | "failed earlier" | "given up" | "changed since release" |
    # "needs <parameters>" (a Megatron LoRA step missing parameters it does not record: not submitted)
    action: str
    detail: str = ""
    flow_run_id: str = ""  # a submitted step's run
    flow_run_name: str = ""


class WatchOutcome(BaseModel):
    run_root: str
    actions: List[StepAction] = []
    outcomes: List[StepOutcome] = []  # in local mode: what each merge_step subflow did
    waiting: List[str] = []
    published_before: int = 0
    seconds: float = 0.0

    def steps_with(self, action: str) -> List[int]:
        return [a.step for a in self.actions if a.action == action]


def expected_releases(role: str, model: Optional[PublishedRelease], params: WatchParams) -> List[str]:
    """The release folder names a published step of ``role`` has (see the module docstring)."""
    names = [release_folder_name(role, MODEL)]
    if model is not None and model.lora and params.release_adapter:
        names.append(release_folder_name(role, ADAPTER))
    return names


def settled_steps(published: List[PublishedRelease], params: WatchParams) -> tuple[tuple[str, int, str], ...]:
    """(role, step, listing fingerprint) of each step of ``params.roles`` whose every expected release was built
    from that one listing: `plan_steps` leaves such a step alone while its listing is unchanged, so discovery's
    second look spares it (a published LoRA step's marker is not read again each tick)."""
    released = {(p.name, p.step): p for p in published}
    settled = []
    for role in params.roles:
        for (name, step), model in released.items():
            if name != release_folder_name(role, MODEL) or not model.source_listing:
                continue
            have = [released.get((n, step)) for n in expected_releases(role, model, params)]
            if all(h is not None and h.source_listing == model.source_listing for h in have):
                settled.append((role, step, model.source_listing))
    return tuple(settled)


def plan_steps(steps: List[StepRecord], published: List[PublishedRelease], params: WatchParams
               ) -> tuple[List[StepRecord], List[StepRecord], List[str]]:
    """(to merge, changed since released, not ready) — complete minus published, oldest first."""
    released = {(p.name, p.step): p for p in published}
    todo: List[StepRecord] = []
    changed: List[StepRecord] = []
    waiting: List[str] = []
    for step in sorted(steps, key=lambda s: (s.step, s.role)):
        if step.role not in params.roles:
            continue
        if not step.complete:
            waiting.append(f"{step.step} ({step.role or 'sft'}: {step.reason})")
            continue
        model = released.get((release_folder_name(step.role, MODEL), step.step))
        have = [released.get((name, step.step)) for name in expected_releases(step.role, model, params)]
        if any(h is None for h in have):
            todo.append(step)
        elif any(h is not None and h.source_listing and h.source_listing != step.fingerprint for h in have):
            (todo if params.overwrite else changed).append(step)
    if params.max_steps is not None:
        todo = todo[: params.max_steps]
    return todo, changed, waiting


NEEDS = "needs "  # the action's prefix: "needs base_model", "needs lora_alpha, hf_model_path", ...
NEED_TEXT = {
    "base_model": "base weights not saved: pass base_model, the Hugging Face model the run trained from",
    "lora_alpha": "no PEFT export records lora_alpha: pass lora_alpha, the run's LoRA alpha (never guessed)",
    "hf_model_path": "no config.json saved with the weights: pass hf_model_path, a folder with the model's config "
                     "(or base_model, for a step holding only a LoRA adapter)",
}
# a need another parameter also meets: the merge of an adapter-only step saved without a config reads its base
# model's (`merge --base-model`); a full-weights step still needs hf_model_path, and its merge says so
ALSO_MET_BY = {"hf_model_path": ("base_model",)}


def missing_params(step: StepRecord, params: WatchParams) -> List[str]:
    """The parameters ``step`` needs (`StepRecord.needs`) that ``params`` gives neither itself nor through a
    parameter that also meets it (`ALSO_MET_BY`). Such a step is not submitted."""
    return [name for name in step.needs
            if all(getattr(params, given, None) is None for given in (name, *ALSO_MET_BY.get(name, ())))]


def missing_action(step: StepRecord, missing: List[str]) -> StepAction:
    detail = ("not submitted: a step whose merge needs what it does not record; "
              + "; ".join(NEED_TEXT.get(name, f"pass {name}") for name in missing))
    return StepAction(step=step.step, role=step.role, action=NEEDS + ", ".join(missing), detail=detail)


def submitted_action(step: StepRecord, run: SubmittedRun) -> StepAction:
    """The row of a submitted step, with its run's id and NAME (the artifact shows the name, linked)."""
    return StepAction(step=step.step, role=step.role, action=SUBMITTED.get(run.action, run.action),
                      detail=run.detail, flow_run_id=run.flow_run_id, flow_run_name=run.flow_run_name)


def published_step_count(published: List[PublishedRelease]) -> int:
    """How many STEPS have a release (a LoRA step's model and adapter releases are one step)."""
    return len({(release.name.removesuffix("-adapter"), release.step) for release in published})


@flow(name="merge-new-steps", flow_run_name=watch_run_name, log_prints=True)
def merge_new_steps(run_root: RunRoot, release_root: ReleaseRoot = "", roles: Roles = DEFAULT_ROLES,
                    merge_deployment: MergeDeployment = "merge-step/gpu", max_steps: MaxSteps = 0,
                    dtype: Dtype = AS_STORED, max_shard_size: MaxShardSize = DEFAULT_SHARD_SIZE,
                    hf_model_path: HfModelPath = "", weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT,
                    validate_forward: ValidateForward = True, reference_url: ReferenceUrl = "",
                    release_adapter: ReleaseAdapter = True, include_base: IncludeBase = True, lora_alpha: Alpha = 0,
                    base_model: BaseModelUrl = "", base_model_id: BaseModelId = "", overwrite: Overwrite = False,
                    staging_root: StagingRoot = "", workers: Workers = 0, ray_address: RayCluster = "", hub_repo: HubRepo = "",
                    hub_revision: HubRevision = DEFAULT_HUB_REVISION, hub_moving_ref: HubMovingRef = "",
                    hub_private: HubPrivate = False, hub_token_secret: HubTokenSecret = "",
                    mlflow_model: MlflowModel = "", mlflow_tracking_uri: MlflowTrackingUri = "") -> WatchOutcome:
    """Merge every complete, unpublished step of ``run_root`` (see the module docstring; each parameter's text: its
    type in `flows.params`)."""
    params = WatchParams(**locals())
    label_flow_run(params.run_root)
    with storage_credentials():
        return watch(params)


def watch(params: WatchParams) -> WatchOutcome:
    """The body of `merge_new_steps` (inside a flow run)."""
    logger = get_run_logger()
    started = time.perf_counter()
    listed_at = dt.datetime.now(dt.timezone.utc)  # a run that ended after this cannot be judged by this listing
    published = list(find_published(params.release_root_url))
    discovery = discover_steps(params.run_root, tuple(params.roles), settled_steps(published, params))
    todo, changed, waiting = plan_steps(list(discovery.steps), published, params)
    outcome = WatchOutcome(run_root=params.run_root, waiting=waiting, published_before=published_step_count(published))
    for step in changed:
        outcome.actions.append(StepAction(step=step.step, role=step.role, action="changed since release",
                                          detail="the checkpoint was rewritten after its release; "
                                                 "run with overwrite to replace the release"))
    deployed = deployment.id is not None
    for step in todo:
        missing = missing_params(step, params)
        if missing:
            outcome.actions.append(missing_action(step, missing))
            continue
        step_params = params.step_params(step)
        if deployed:
            try:
                run = submit_step_run(params.merge_deployment, step_params.flow_parameters(),
                                      step_key(step.run_root, step.role, step.step), listing=step.fingerprint,
                                      tags=run_tags(step.run_root, step.role, step.step), listed_at=listed_at)
            except Exception as exc:  # noqa: BLE001 - one step's trouble must not stop the others
                logger.warning("could not submit step %s (%s): %s", step.step, step.role or "sft", exc)
                outcome.actions.append(StepAction(step=step.step, role=step.role, action="error",
                                                  detail=f"{type(exc).__name__}: {exc}"))
                continue
            outcome.actions.append(submitted_action(step, run))
            continue
        from flows.merge_step import merge_step  # local mode only: a deployed watcher never imports torch

        state = merge_step(**step_params.flow_parameters(), return_state=True)
        if state.is_failed():
            error = state.result(raise_on_failure=False)
            outcome.actions.append(StepAction(step=step.step, role=step.role, action="failed",
                                              detail=f"{type(error).__name__}: {error}"))
            continue
        result: StepOutcome = state.result()
        outcome.outcomes.append(result)
        detail = ", ".join(r.url for r in result.releases) or result.reason
        action = LOCAL.get(result.status, result.status)
        outcome.actions.append(StepAction(step=step.step, role=step.role, action=action, detail=detail))
    outcome.seconds = time.perf_counter() - started
    rows = [a.model_dump() for a in outcome.actions]
    create_markdown_artifact(watch_summary(params.run_root, rows, waiting, outcome.seconds,
                                           published_steps=outcome.published_before, releases=len(published)),
                             key=artifact_key("watch", params.run_root.rstrip("/").rsplit("/", 1)[-1],
                                              hashlib.sha256(params.run_root.encode()).hexdigest()[:8]),
                             description=f"{len(todo)} new step(s) of {params.run_root}")
    logger.info("%d new step(s), %d not ready, %d already published (%d releases)", len(todo), len(waiting),
                outcome.published_before, len(published))
    failed = [a for a in outcome.actions if a.action in ("failed", "error") or a.action.startswith(NEEDS)]
    if failed:
        raise RuntimeError(f"{len(failed)} step(s) failed: " + ", ".join(f"{a.step} ({a.detail})" for a in failed))
    return outcome
