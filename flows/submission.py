"""One deployment run per step: ``run_deployment`` with the idempotency key ``{run_root}:{role}:{step}``.

The Prefect server keeps one flow run per (deployment's flow, idempotency key): submitting the same
step twice — two watcher ticks while a merge is still running, a webhook delivered twice — gives
back the run already there instead of starting another.

A run of that key that finished without leaving the step published is handled deterministically:
- Completed, Crashed or Cancelled: the release was deleted since, or the run never got to it.
  A new run is submitted under ``<key>:after:<previous run id>`` — the same key for every watcher
  that sees the same finished run, so this too happens once.
- Failed: a named error (corrupt shard, failed validation) or retries exhausted. It is NOT
  resubmitted (it would fail the same way every tick); a person re-runs it from the UI.
"""

from typing import Any, Optional

from pydantic import BaseModel

MAX_KEY_CHAIN = 100


class SubmittedRun(BaseModel):
    """A deployment run that merges one step: its id, key, state when seen, and whether it is new."""

    flow_run_id: str
    idempotency_key: str
    state: str
    resubmitted: bool = False
    failed_earlier: bool = False


def _state_of(run: Any) -> tuple[str, Optional[Any]]:
    state = getattr(run, "state", None)
    return (state.name if state is not None else "Scheduled"), state


def submit_step_run(deployment: str, parameters: dict, key: str, as_subflow: bool = True) -> SubmittedRun:
    """Create (or find) the run of ``deployment`` for idempotency ``key`` (see the module docstring)."""
    from prefect.deployments import run_deployment

    current_key = key
    resubmitted = False
    for _ in range(MAX_KEY_CHAIN):
        run = run_deployment(deployment, parameters=parameters, idempotency_key=current_key, timeout=0,
                             as_subflow=as_subflow)
        name, state = _state_of(run)
        if state is None or not state.is_final():
            return SubmittedRun(flow_run_id=str(run.id), idempotency_key=current_key, state=name,
                                resubmitted=resubmitted)
        if state.is_failed():
            return SubmittedRun(flow_run_id=str(run.id), idempotency_key=current_key, state=name,
                                resubmitted=resubmitted, failed_earlier=True)
        current_key = f"{key}:after:{run.id}"
        resubmitted = True
    raise RuntimeError(f"more than {MAX_KEY_CHAIN} finished runs for {key}; refusing to submit another")
