"""The event a training job emits when it has saved a checkpoint: ``stepmerge.checkpoint.saved``.

The ``merge-step`` deployment's trigger (deployments/prefect.yaml) listens for it and starts a
merge of that step with ``run_root``, ``step`` and ``role`` from the payload. `stepmerge notify`
(`flows.cli`) emits it; so can any job with ``prefect.events.emit_event`` or a ``POST
/api/events`` to the server.

Resource: ``prefect.resource.id = stepmerge.checkpoint.<run_root>:<role>:<step>`` (the step's key,
`flows.step_keys.step_key`), with ``stepmerge.run_root`` / ``stepmerge.step`` / ``stepmerge.role`` labels.

`emit_checkpoint_saved` is for a job that must know: it POSTs the event to the server's events API
and waits for the answer; an unreachable server or an HTTP error raises `EventNotDelivered` (the
command's exit code says so). Prefect's own ``emit_event`` queues the event in a background worker
that logs and drops what it cannot send: fine for telemetry, not for a trigger a job relies on.
"""

import os
from typing import Optional

from flows.step_keys import normalized_run_root, step_key
from flows.url_checks import checked_url
from merge_engine.errors import InvalidOption, StepmergeError
from merge_engine.storage.urls import scheme_of

CHECKPOINT_SAVED = "stepmerge.checkpoint.saved"
RESOURCE_PREFIX = "stepmerge.checkpoint."


class EventNotDelivered(StepmergeError):
    """The Prefect server could not be reached, or did not accept the event (retry later)."""

    exit_code = 1


def notified_run_root(value: str) -> str:
    """A run root as a notification carries it: checked like a flow parameter (`checked_url`), and a
    relative local path made absolute (the worker that merges does not share the job's directory).

    A local path is made absolute BEFORE the check, so ``../runs/exp1`` (the job's own folder, named
    from where it runs) is sent as ``/abs/runs/exp1``; a URL with ``..`` is still refused."""
    if "://" not in value and value.strip() and not value.startswith("/"):
        value = os.path.abspath(value)
    try:
        url = checked_url(value)
    except ValueError as exc:
        raise InvalidOption(f"--run-root {value!r}: {exc}") from None
    return url if scheme_of(url) is not None else normalized_run_root(os.path.abspath(url))


def checkpoint_saved_event(run_root: str, step: int, role: str = "actor") -> dict:
    """The event's fields (``event``, ``resource``, ``payload``) for one saved checkpoint."""
    run_root = normalized_run_root(run_root)
    return {
        "event": CHECKPOINT_SAVED,
        "resource": {
            "prefect.resource.id": RESOURCE_PREFIX + step_key(run_root, role, step),
            "prefect.resource.name": f"{run_root} step {int(step)} ({role or 'sft'})",
            "stepmerge.run_root": run_root,
            "stepmerge.step": str(int(step)),
            "stepmerge.role": role,
        },
        "payload": {"run_root": run_root, "step": int(step), "role": role},
    }


def emit_checkpoint_saved(run_root: str, step: int, role: str = "actor") -> Optional[str]:
    """POST the event to the configured Prefect server's events API; the event id once it is accepted.

    Raises `InvalidOption` when no server is configured (``PREFECT_API_URL``), `EventNotDelivered`
    when the server cannot be reached or answers with an error.
    """
    from prefect.client.orchestration import get_client
    from prefect.events import Event
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    if not api_url:
        raise InvalidOption("no Prefect server configured: set PREFECT_API_URL (e.g. http://host:4200/api)")
    event = Event(**checkpoint_saved_event(run_root, step, role))
    try:
        with get_client(sync_client=True) as client:
            response = client.request("POST", "/events", json=[event.model_dump(mode="json")])
    except Exception as exc:  # noqa: BLE001 - connection refused, timeouts, HTTP errors: all "not delivered"
        status = getattr(getattr(exc, "response", None), "status_code", None)
        what = f"HTTP {status}" if status is not None else type(exc).__name__
        raise EventNotDelivered(f"event not delivered to {api_url} ({what}: {exc})") from None
    if not 200 <= response.status_code < 300:
        raise EventNotDelivered(f"event not delivered to {api_url} (HTTP {response.status_code})")
    return str(event.id)
