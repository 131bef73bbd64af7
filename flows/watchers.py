"""Who will merge a step that is not complete yet: a run that found it so may end green only then.

A ``merge-step`` (or ``release-adapter``) run that finds its step still being written did nothing.
It ends Completed only when someone will come back for the step (`retrying_watcher`):
- a deployment of ``merge-new-steps`` watching this run root (same run root, an active schedule,
  not paused): ``the watcher merge-new-steps/watch``;
- or the ``merge-new-steps`` run that started this run as a subflow (local mode), which lists the
  step as "not ready" in its own report.
Otherwise nobody would ever merge it: the run fails with `merge_engine.errors.IncompleteCheckpoint`
saying so (`not_ready_error`). A step that is not there at all is `StepNotFound` whatever the
watchers (`flows.stages.ready_checkpoint`), and a run root with no files `RunRootNotFound`.
"""

from typing import List, Optional

from flows.step_keys import normalized_run_root
from merge_engine.errors import IncompleteCheckpoint

WATCH_FLOW = "merge-new-steps"


def watching_deployments(run_root: str) -> List[str]:
    """``merge-new-steps/<name>`` of every deployment watching ``run_root`` on an active schedule."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    wanted = normalized_run_root(run_root)
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[WATCH_FLOW])))
    names = []
    for deployment in deployments:
        root = (deployment.parameters or {}).get("run_root")
        active = not deployment.paused and any(s.active for s in deployment.schedules or [])
        if isinstance(root, str) and normalized_run_root(root) == wanted and active:
            names.append(f"{WATCH_FLOW}/{deployment.name}")
    return sorted(names)


def parent_watcher_run() -> Optional[str]:
    """The name of the ``merge-new-steps`` run this flow run is a subflow of, if it is one."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    parent = flow_run.parent_flow_run_id
    if not parent:
        return None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(parent)
        flow = client.read_flow(run.flow_id)
    return run.name if flow.name == WATCH_FLOW else None


def retrying_watcher(run_root: str) -> Optional[str]:
    """Who merges ``run_root``'s steps later (see the module docstring), in words; None: nobody."""
    parent = parent_watcher_run()
    if parent:
        return f"the watcher run {parent!r} that started this run (it reports the step as not ready)"
    deployed = watching_deployments(run_root)
    if deployed:
        return "the watcher " + ", ".join(deployed) + " (on its schedule)"
    return None


def not_ready_error(run_root: str, step: int, role: str, reason: str, url: Optional[str] = None) -> IncompleteCheckpoint:
    """The error of a step not complete yet that no watcher will come back for."""
    return IncompleteCheckpoint(
        f"step {step} ({role or 'sft'}) is not complete yet ({reason}), and no watcher watches "
        f"{normalized_run_root(run_root)} to merge it later: run this step again once it is complete, or deploy a "
        "watcher for this run root (deployments/README.md)", url or run_root)
