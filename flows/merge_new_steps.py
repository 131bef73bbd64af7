"""Flow ``merge-new-steps`` (the watcher, on an interval schedule): merge every step not yet released.

Each run computes, from two listings, COMPLETE STEPS MINUS PUBLISHED STEPS — no high-water mark, so
a step that completes late, or a lower step that appears after a higher one, is still merged; a
step whose release was deleted is merged again. Steps still being written are reported as "not
ready" and left for a later run.

One merge per step:
- from a deployment (the watcher deployed on the ``cpu`` pool), each step is a run of the
  ``merge_deployment`` (``merge-step/gpu``) submitted with the idempotency key
  ``{run_root}:{role}:{step}`` (`flows.submission`): a merge still running is not started twice;
- in local mode (no deployment), each step is an in-process ``merge_step`` subflow, one after the other.
A step that fails does not stop the others; the run fails at the end if any step failed. A
markdown artifact lists what happened to each step. A release whose step was rewritten since
(its listing differs from the one recorded in the manifest) is reported, and re-merged only with
``overwrite``.
"""

import hashlib
import time
from typing import List

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import deployment
from pydantic import BaseModel

from flows.merge_step import merge_step
from flows.params import WatchParams
from flows.stages import StepOutcome
from flows.submission import submit_step_run
from flows.summaries import watch_summary
from tasks.discover import PublishedRelease, discover_steps, find_published
from tasks.progress import artifact_key
from tasks.records import StepRecord
from tasks.releases import ADAPTER, MODEL, release_folder_name


class StepAction(BaseModel):
    step: int
    role: str
    action: str  # "merged" | "already published" | "submitted" | "running" | "failed" | "changed since release"
    detail: str = ""


class WatchOutcome(BaseModel):
    run_root: str
    actions: List[StepAction] = []
    outcomes: List[StepOutcome] = []  # in local mode: what each merge_step subflow did
    waiting: List[str] = []
    published_before: int = 0
    seconds: float = 0.0

    def steps_with(self, action: str) -> List[int]:
        return [a.step for a in self.actions if a.action == action]


def expected_releases(step: StepRecord, params: WatchParams) -> List[str]:
    names = [release_folder_name(step.role, MODEL)]
    if step.lora_hint and params.release_adapter:
        names.append(release_folder_name(step.role, ADAPTER))
    return names


def plan_steps(steps: List[StepRecord], published: List[PublishedRelease], params: WatchParams):
    """(to merge, changed since released, not ready) — complete minus published, oldest first."""
    released = {(p.name, p.step): p for p in published}
    todo, changed, waiting = [], [], []
    for step in sorted(steps, key=lambda s: (s.step, s.role)):
        if step.role not in params.roles:
            continue
        if not step.complete:
            waiting.append(f"{step.step} ({step.role or 'sft'}: {step.reason})")
            continue
        have = [released.get((name, step.step)) for name in expected_releases(step, params)]
        if any(h is None for h in have):
            todo.append(step)
        elif any(h.source_listing and h.source_listing != step.fingerprint for h in have):
            (todo if params.overwrite else changed).append(step)
    if params.max_steps is not None:
        todo = todo[: params.max_steps]
    return todo, changed, waiting


@flow(name="merge-new-steps", log_prints=True)
def merge_new_steps(params: WatchParams) -> WatchOutcome:
    """Merge every complete, unpublished step of ``params.run_root`` (see the module docstring)."""
    logger = get_run_logger()
    started = time.perf_counter()
    discovery = discover_steps(params.run_root)
    published = list(find_published(params.release_root_url))
    todo, changed, waiting = plan_steps(list(discovery.steps), published, params)
    outcome = WatchOutcome(run_root=params.run_root, waiting=waiting, published_before=len(published))
    for step in changed:
        outcome.actions.append(StepAction(step=step.step, role=step.role, action="changed since release",
                                          detail="the checkpoint was rewritten after its release; "
                                                 "run with overwrite to replace the release"))
    deployed = deployment.id is not None
    failures = 0
    for step in todo:
        step_params = params.step_params(step)
        if deployed:
            run = submit_step_run(params.merge_deployment, {"params": step_params.model_dump(mode="json")}, step.key)
            action = "failed" if run.failed_earlier else ("submitted" if run.state == "Scheduled" else "running")
            failures += run.failed_earlier
            outcome.actions.append(StepAction(step=step.step, role=step.role, action=action,
                                              detail=f"flow run {run.flow_run_id} ({run.state})"))
            continue
        state = merge_step(step_params, return_state=True)
        if state.is_failed():
            failures += 1
            error = state.result(raise_on_failure=False)
            outcome.actions.append(StepAction(step=step.step, role=step.role, action="failed",
                                              detail=f"{type(error).__name__}: {error}"))
            continue
        result: StepOutcome = state.result()
        outcome.outcomes.append(result)
        action = {"published": "merged", "already_published": "already published"}.get(result.status, result.status)
        detail = ", ".join(r.url for r in result.releases) or result.reason
        outcome.actions.append(StepAction(step=step.step, role=step.role, action=action, detail=detail))
    outcome.seconds = time.perf_counter() - started
    rows = [a.model_dump() for a in outcome.actions]
    create_markdown_artifact(watch_summary(params.run_root, rows, waiting, outcome.seconds),
                             key=artifact_key("watch", params.run_root.rstrip("/").rsplit("/", 1)[-1],
                                              hashlib.sha256(params.run_root.encode()).hexdigest()[:8]),
                             description=f"{len(todo)} new step(s) of {params.run_root}")
    logger.info("%d new step(s), %d not ready, %d already published", len(todo), len(waiting), len(published))
    if failures:
        raise RuntimeError(f"{failures} step(s) failed: "
                           + ", ".join(f"{a.step} ({a.detail})" for a in outcome.actions if a.action == "failed"))
    return outcome
