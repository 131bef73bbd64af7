"""The event a training job emits when it has saved a checkpoint: ``stepmerge.checkpoint.saved``.

The ``merge-step`` deployment's trigger (deployments/prefect.yaml) listens for it and starts a
merge of that step with ``run_root``, ``step`` and ``role`` from the payload. `stepmerge notify`
(`merge_engine.cli`) emits it; so can any job with ``prefect.events.emit_event`` or a ``POST
/api/events`` to the server.

Resource: ``prefect.resource.id = stepmerge.checkpoint.<run_root>:<role>:<step>`` (the step's key),
with ``stepmerge.run_root`` / ``stepmerge.step`` / ``stepmerge.role`` labels.
"""

from typing import Optional

CHECKPOINT_SAVED = "stepmerge.checkpoint.saved"
RESOURCE_PREFIX = "stepmerge.checkpoint."


def checkpoint_saved_event(run_root: str, step: int, role: str = "actor") -> dict:
    """The event's fields (``event``, ``resource``, ``payload``) for one saved checkpoint."""
    run_root = run_root.rstrip("/")
    key = f"{run_root}:{role}:{int(step)}"
    return {
        "event": CHECKPOINT_SAVED,
        "resource": {
            "prefect.resource.id": RESOURCE_PREFIX + key,
            "prefect.resource.name": f"{run_root} step {int(step)} ({role or 'sft'})",
            "stepmerge.run_root": run_root,
            "stepmerge.step": str(int(step)),
            "stepmerge.role": role,
        },
        "payload": {"run_root": run_root, "step": int(step), "role": role},
    }


def emit_checkpoint_saved(run_root: str, step: int, role: str = "actor") -> Optional[str]:
    """Emit the event to the configured Prefect server and wait until it is sent; the event id.

    Raises RuntimeError when no server is configured (``PREFECT_API_URL``) or the event was not sent.
    """
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RuntimeError("no Prefect server configured: set PREFECT_API_URL (e.g. http://host:4200/api)")
    event = emit_event(**checkpoint_saved_event(run_root, step, role))
    EventsWorker.drain_all()
    if event is None:
        raise RuntimeError("Prefect did not emit the event (events are disabled for this client)")
    return str(event.id)
