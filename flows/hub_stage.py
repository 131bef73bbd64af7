"""The push stage of the flows: each published release of a step -> its revision on the Hugging Face Hub.

Runs after publish, one ``push-to-hub`` task per release (`tasks.hub.push_release`), only when the flow has a
``hub_repo``. A push that fails is recorded in the step's outcome (`flows.outcomes.HubPushOutcome`, one line)
and in the summary; the release stays published, and the flow raises the push's error after its summary is
written (`raise_failed_push`), so the run ends Failed at that stage. Running the flow again for the step is a
cache hit for the release and pushes again (no commit when the revision already holds the release).
"""

from typing import Any, List, Optional

from flows.outcomes import HubPushOutcome, ReleaseOutcome, StepOutcome
from merge_engine.errors import one_line
from merge_engine.release.folders import ADAPTER
from tasks.hub import HubTarget, push_release


def hub_target(params: Any) -> Optional[HubTarget]:
    """The flow's Hub target from its parameters (``hub_repo`` and the others); None without a ``hub_repo``."""
    repo = getattr(params, "hub_repo", None)
    if not repo:
        return None
    return HubTarget(repo=repo, template=getattr(params, "hub_revision", None) or HubTarget.template,
                     moving_ref=getattr(params, "hub_moving_ref", None) or None,
                     private=bool(getattr(params, "hub_private", False)),
                     token_secret=getattr(params, "hub_token_secret", None) or None)


def push_releases(timer: Any, outcome: StepOutcome, target: Optional[HubTarget]) -> Optional[BaseException]:
    """Push each release of ``outcome`` to ``target`` (a stage per release, timed by ``timer``), recording each in
    ``outcome.pushes``; stops at the first failure and returns its error (None: all pushed, or no target)."""
    if target is None:
        return None
    for release in outcome.releases:
        try:
            pushed = timer.run("push-adapter" if release.kind == ADAPTER else "push", push_release, release.url,
                               target, outcome.step, outcome.role, release.kind == ADAPTER)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised by the flow after its summary
            outcome.pushes.append(failed_push(release, target, exc))
            return exc
        outcome.pushes.append(HubPushOutcome(kind=release.kind, repo=pushed.repo_id, revision=pushed.revision,
                                             commit=pushed.commit, committed=pushed.committed, files=pushed.files,
                                             total_bytes=pushed.total_bytes, moved_refs=list(pushed.moved_refs)))
    return None


def failed_push(release: ReleaseOutcome, target: HubTarget, exc: BaseException) -> HubPushOutcome:
    return HubPushOutcome(kind=release.kind, repo=target.repo, error=one_line(f"{type(exc).__name__}: {exc}", 400))


def raise_failed_push(error: Optional[BaseException]) -> None:
    """Fail the flow run with the push's (or the registration's) error (the release stays published), after the
    summary was written."""
    if error is not None:
        raise error


__all__ = ["hub_target", "push_releases", "raise_failed_push"]
