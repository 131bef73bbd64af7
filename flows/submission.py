"""One deployment run per step, and when a step gets another one.

Keys (the whole rule; deployments/README.md says the same):
- the first run of a step is keyed ``K = {run_root}:{role}:{step}`` (`flows.step_keys.step_key`);
- every later run is keyed ``K:after:<id of the run before it>`` (`flows.step_keys.resubmission_key`).
The Prefect server keeps one flow run per (flow, idempotency key), so submitting a key again gives
back the run already there. A chain K -> K:after:R1 -> K:after:R2 ... is walked from K; each
link is derived from the finished run before it, so every submitter that sees the same finished
run (two watcher ticks, two watchers, the webhook) derives the same next key: it is created once.

Whether a finished run is followed by another (`decide`):
- not finished (scheduled, pending, running, paused): it is the step's run; nothing new;
- the step's listing changed since the run was submitted (the watcher tags its runs with the
  listing fingerprint, ``stepmerge-listing:<16 hex>``): a new input, a new run, whatever the state
  (a checkpoint rewritten, or one whose last file was still being written);
- Completed: for the watcher, the step still lacks a release (it only submits those): the release
  was deleted since, so a new run — at most `MAX_RUNS_PER_LISTING` in a row for one listing, then it
  is given up (a run that completes without publishing would otherwise repeat every tick). Unless the
  run ended after the watcher listed the releases (``listed_at``, less `CLOCK_MARGIN_S` for the server's
  clock): that listing cannot show its release, so it is the step's run, and the next tick looks again
  (a run that published while the tick ran is never followed by a second, needless run). For the
  webhook (``rebuild_completed=False``) a completed run is the answer to a redelivered call;
- Failed or Crashed (outage longer than the task retries, a bug since fixed, a worker killed):
  resubmitted after a pause of ``RESUBMIT_BASE_DELAY_S * 2**(n-1)`` from the end of the n-th failed
  run in a row for this listing, until `MAX_RUNS_PER_LISTING` runs failed: then it is given up and
  reported; a person reruns it from the UI (or the checkpoint changes);
- Cancelled: a person stopped it; not resubmitted unless the listing changes.
Runs created without a listing (webhook, trigger, UI) count as the same listing.
"""

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Literal, Optional, Sequence

from pydantic import BaseModel

from flows.step_keys import resubmission_key

MAX_KEY_CHAIN = 100
MAX_RUNS_PER_LISTING = 3
RESUBMIT_BASE_DELAY_S = float(os.environ.get("STEPMERGE_RESUBMIT_BASE_DELAY_S", "600"))
CLOCK_MARGIN_S = 60.0  # how far the server's clock (a run's end) may be behind the watcher's (its listing)
LISTING_TAG_PREFIX = "stepmerge-listing:"
STATES_FAILED = ("FAILED", "CRASHED")


def listing_tag(listing: str) -> str:
    """The tag a watcher-submitted run carries: the step's listing fingerprint (16 hex digits)."""
    return LISTING_TAG_PREFIX + listing[:16]


def _listing_of(run: Any) -> Optional[str]:
    return next((t[len(LISTING_TAG_PREFIX):] for t in (getattr(run, "tags", None) or [])
                 if t.startswith(LISTING_TAG_PREFIX)), None)


def _state_type(run: Any) -> str:
    state = getattr(run, "state", None)
    return "SCHEDULED" if state is None else str(getattr(state.type, "value", state.type))


def _ended(run: Any) -> dt.datetime:
    ended = getattr(run, "end_time", None) or getattr(getattr(run, "state", None), "timestamp", None)
    return ended or dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class Decision:
    """What to do about the last run of a step's chain: "use" it, "resubmit", "wait" until ``retry_at``,
    or "give_up" (``reason`` says why, for the watcher's report)."""

    action: Literal["use", "resubmit", "wait", "give_up"]
    reason: str = ""
    retry_at: Optional[dt.datetime] = None


def _outcome(state: str) -> str:
    return "failed" if state in STATES_FAILED else state.lower()


def _runs_in_a_row(chain: Sequence[Any], listing: Optional[str], state: str) -> int:
    """How many of the last runs on ``listing`` (untagged runs count as any listing) ended like ``state``
    (Failed and Crashed alike)."""
    on_listing = [r for r in chain if listing is None or _listing_of(r) in (listing, None)]
    count = 0
    for run in reversed(on_listing):
        if _outcome(_state_type(run)) != _outcome(state):
            break
        count += 1
    return count


def decide(chain: Sequence[Any], listing: Optional[str], now: dt.datetime, rebuild_completed: bool,
           listed_at: Optional[dt.datetime] = None) -> Decision:
    """The rule of the module docstring for ``chain[-1]`` (``chain``: the step's runs, oldest first; ``listed_at``:
    when the watcher listed the releases that say the step is unpublished)."""
    last = chain[-1]
    state = _state_type(last)
    if state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        return Decision("use", f"{state.lower()}")
    ran_on = _listing_of(last)
    if listing is not None and ran_on is not None and ran_on != listing[:16]:
        return Decision("resubmit", "the step's files changed since that run was submitted")
    in_a_row = _runs_in_a_row(chain, ran_on, state)
    if state == "CANCELLED":
        return Decision("give_up", "cancelled; resubmitted only when the step's files change")
    if state == "COMPLETED":
        if not rebuild_completed:
            return Decision("use", "completed")
        if listed_at is not None and _ended(last) >= listed_at - dt.timedelta(seconds=CLOCK_MARGIN_S):
            return Decision("use", "completed while this tick ran; its release is looked at next tick")
        if in_a_row >= MAX_RUNS_PER_LISTING:
            return Decision("give_up", f"{in_a_row} runs in a row completed without leaving the step published")
        return Decision("resubmit", "completed, but the step is not published (its release was deleted since)")
    if in_a_row >= MAX_RUNS_PER_LISTING:
        return Decision("give_up", f"{in_a_row} runs in a row failed on these files")
    retry_at = _ended(last) + dt.timedelta(seconds=RESUBMIT_BASE_DELAY_S * 2 ** (in_a_row - 1))
    if now < retry_at:
        return Decision("wait", f"failed ({in_a_row} in a row)", retry_at)
    return Decision("resubmit", f"failed ({in_a_row} in a row); the pause is over")


class SubmittedRun(BaseModel):
    """The run that merges one step: its id, key and state when seen, and what the submitter did.

    ``action``: "submitted" (new), "resubmitted" (new, after a finished run), "running" (a run of
    the step is already going), "completed" (webhook: the step's run finished), "waiting" (the last
    run failed; resubmitted after ``retry_at``) or "gave up" (a person reruns it).
    """

    flow_run_id: str
    idempotency_key: str
    state: str
    action: str
    flow_run_name: str = ""
    detail: str = ""
    resubmitted: bool = False
    failed_earlier: bool = False
    retry_at: Optional[dt.datetime] = None


def submit_chain(create: Callable[[str], Any], key: str, listing: Optional[str] = None,
                 rebuild_completed: bool = True, now: Optional[dt.datetime] = None,
                 listed_at: Optional[dt.datetime] = None) -> SubmittedRun:
    """Walk the step's chain from ``key`` with ``create(key) -> flow run`` (create-or-get by idempotency
    key) and return the run to report (see the module docstring; ``listed_at``: `decide`'s)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    chain: List[Any] = []
    current = key
    for _ in range(MAX_KEY_CHAIN):
        run = create(current)
        chain.append(run)
        created = getattr(run, "id", None)
        decision = decide(chain, listing, now, rebuild_completed, listed_at)
        name = run.state.name if getattr(run, "state", None) is not None else "Scheduled"
        if decision.action == "resubmit":
            current = resubmission_key(key, created)
            continue
        run_id, run_name = str(created), str(getattr(run, "name", "") or "")
        resubmitted = len(chain) > 1
        if decision.action == "use":
            final = _state_type(run) == "COMPLETED"
            action = "completed" if final else ("submitted" if name == "Scheduled" and len(chain) == 1 else
                                                 "resubmitted" if name == "Scheduled" else "running")
            return SubmittedRun(action=action, detail=f"flow run {created} ({name})", flow_run_id=run_id,
                                flow_run_name=run_name, idempotency_key=current, state=name, resubmitted=resubmitted)
        if decision.action == "wait":
            retry_at = decision.retry_at
            if retry_at is None:
                raise ValueError(f"a decision to wait names no time to resubmit {key} at")
            return SubmittedRun(action="waiting", failed_earlier=True, retry_at=retry_at,
                                detail=f"flow run {created} {decision.reason}; resubmitted after "
                                       f"{retry_at.isoformat(timespec='seconds')}", flow_run_id=run_id,
                                flow_run_name=run_name, idempotency_key=current, state=name, resubmitted=resubmitted)
        return SubmittedRun(action="gave up", failed_earlier=_state_type(run) in STATES_FAILED,
                            detail=f"flow run {created}: {decision.reason}; given up: rerun it from the UI, "
                                   "or rewrite the step", flow_run_id=run_id, flow_run_name=run_name,
                            idempotency_key=current, state=name, resubmitted=resubmitted)
    raise RuntimeError(f"more than {MAX_KEY_CHAIN} runs for {key}; refusing to submit another")


def submit_step_run(deployment: str, parameters: dict, key: str, listing: Optional[str] = None,
                    as_subflow: bool = True, tags: Sequence[str] = (),
                    listed_at: Optional[dt.datetime] = None) -> SubmittedRun:
    """The watcher's submission of one step to ``deployment`` (tagged with its ``listing`` and ``tags``;
    ``listed_at``: when the watcher listed the releases, `decide`)."""
    from prefect.deployments import run_deployment

    run_tags = [*tags, *([listing_tag(listing)] if listing else [])] or None

    def create(current: str) -> Any:
        return run_deployment(deployment, parameters=parameters, idempotency_key=current, timeout=0,
                              as_subflow=as_subflow, tags=run_tags)

    return submit_chain(create, key, listing=listing, rebuild_completed=True, listed_at=listed_at)
