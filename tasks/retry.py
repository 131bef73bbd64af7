"""Which task failures are retried, and how: transient storage faults only, with backoff and jitter.

Contract:
- `transient_fault` is every stage task's ``retry_condition_fn``: True exactly when the exception
  that failed the attempt is a transient storage fault by `merge_engine.storage.is_transient`
  (connection reset or refused, timeout, throttling, 5xx, `ReleaseBusy`). Every `StepmergeError`
  (bad input: corrupt shard, incomplete checkpoint, failed validation, ...) and anything not
  recognised fails the task at once, once.
- `RETRY_OPTIONS` are the task options: `RETRIES` attempts after the first, delays growing as
  ``RETRY_BASE_DELAY_S * 2**n`` with Prefect's jitter (``retry_jitter_factor``) on top.
  ``STEPMERGE_TASK_RETRIES`` / ``STEPMERGE_RETRY_BASE_DELAY_S`` override them (read at import).
These retries sit on top of the engine's own per-request retries (`merge_engine.storage`): a fault
the engine rides out never reaches Prefect; an outage longer than that fails the attempt, and the
task retries it after a pause long enough for a server to come back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect.tasks import exponential_backoff

from merge_engine.errors import StepmergeError
from merge_engine.storage import is_transient

logger = logging.getLogger(__name__)

RETRIES = int(os.environ.get("STEPMERGE_TASK_RETRIES", "3"))
RETRY_BASE_DELAY_S = float(os.environ.get("STEPMERGE_RETRY_BASE_DELAY_S", "10"))
RETRY_JITTER_FACTOR = 0.5


def failure_exception(state: Any) -> BaseException | None:
    """The exception a failed task state carries (None when it carries none)."""
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # noqa: BLE001 - a state whose result cannot be read raised this
        return exc
    return result if isinstance(result, BaseException) else None


def transient_fault(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only a transient fault: a `StepmergeError` that says whether it is
    (``transient``: the Hub or MLflow out of reach or busy), else a transient storage fault."""
    exc = failure_exception(state)
    said = getattr(exc, "transient", None) if isinstance(exc, StepmergeError) else None
    verdict = exc is not None and (said if isinstance(said, bool) else is_transient(exc))
    name = getattr(task, "name", "task")
    if exc is not None:
        logger.info("%s failed with %s: %s -> %s", name, type(exc).__name__, exc,
                    "transient, retrying" if verdict else "permanent, not retried")
    return verdict


RETRY_OPTIONS: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay_seconds": exponential_backoff(backoff_factor=RETRY_BASE_DELAY_S),
    "retry_jitter_factor": RETRY_JITTER_FACTOR,
    "retry_condition_fn": transient_fault,
}
