"""Tell the Prefect server a checkpoint was saved, with the Python standard library only.

For training images without stepmerge (or Prefect) installed: copy this one file next to the
training code. It POSTs the event ``stepmerge.checkpoint.saved`` to the server's ``/api/events``
(the same event as ``stepmerge notify``, `flows.events.checkpoint_saved_event`), which the
``merge-step/gpu`` deployment's automation turns into a merge of that step.

    python verl_notify.py --api-url http://prefect:4200/api --run-root s3://bucket/exp1 --step 120

In a verl job (verl has no public checkpoint callback; ``_save_checkpoint`` of its trainer is where a
step's folder is complete, including the tracker file):

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl_notify import notify_checkpoint_saved

    class NotifyingTrainer(RayPPOTrainer):
        def _save_checkpoint(self):
            super()._save_checkpoint()
            try:
                notify_checkpoint_saved(os.environ["PREFECT_API_URL"], RUN_ROOT, self.global_steps)
            except OSError as exc:  # the server is down: the watcher merges the step on its next run
                print(f"stepmerge: checkpoint event not delivered: {exc}")

``RUN_ROOT`` is where ``trainer.default_local_dir`` is (an ``s3://`` / ``gs://`` URL the workers read,
or a shared-disk path: send it absolute). ``PREFECT_API_AUTH_STRING`` (``user:password``) is sent as
basic auth when set. The exit status of the command: 0 sent, 1 not delivered, 2 bad arguments.
"""

import argparse
import base64
import datetime as dt
import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from typing import Optional

EVENT = "stepmerge.checkpoint.saved"
RESOURCE_PREFIX = "stepmerge.checkpoint."


def canonical_run_root(run_root: str) -> str:
    """One spelling per run root, as `flows.step_keys.normalized_run_root` writes it (``file:///x``,
    ``file://localhost/x`` and ``file:/x`` are ``/x``, RFC 8089; schemes in lower case)."""
    if "://" in run_root:
        scheme, rest = run_root.split("://", 1)
        scheme = {"gcs": "gs", "s3a": "s3"}.get(scheme.lower(), scheme.lower())
        if scheme in ("file", "local") and rest.lower().startswith("localhost/"):
            rest = rest[len("localhost"):]
        run_root = rest if scheme in ("file", "local") and rest.startswith("/") else f"{scheme}://{rest}"
    elif run_root[:5].lower() == "file:" and run_root[5:6] == "/":
        run_root = "/" + run_root[5:].lstrip("/")
    return run_root.rstrip("/") or run_root[:1]


def saved_event_json(run_root: str, step: int, role: str = "actor") -> dict:
    """The event, with the fields the server requires (``id``, ``occurred``)."""
    run_root = canonical_run_root(run_root)
    step = int(step)
    key = f"{run_root}:{role}:{step}"
    return {
        "id": str(uuid.uuid4()),
        "occurred": dt.datetime.now(dt.timezone.utc).isoformat(),
        "event": EVENT,
        "resource": {"prefect.resource.id": RESOURCE_PREFIX + key,
                     "prefect.resource.name": f"{run_root} step {step} ({role or 'sft'})",
                     "stepmerge.run_root": run_root, "stepmerge.step": str(step), "stepmerge.role": role},
        "payload": {"run_root": run_root, "step": step, "role": role},
    }


def notify_checkpoint_saved(api_url: str, run_root: str, step: int, role: str = "actor",
                            auth_string: Optional[str] = None, timeout_s: float = 10.0) -> str:
    """POST the event to ``<api_url>/events``; its id once the server accepted it.

    Raises `OSError` (``urllib.error.URLError`` / ``HTTPError``) when it was not delivered.
    """
    event = saved_event_json(run_root, step, role)
    request = urllib.request.Request(api_url.rstrip("/") + "/events", data=json.dumps([event]).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    auth_string = auth_string if auth_string is not None else os.environ.get("PREFECT_API_AUTH_STRING")
    if auth_string:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth_string.encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if not 200 <= response.status < 300:
            raise urllib.error.HTTPError(request.full_url, response.status, "not accepted", response.headers, None)
    return event["id"]


def notify_command(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"),
                        help="the Prefect API, e.g. http://prefect:4200/api (default: $PREFECT_API_URL)")
    parser.add_argument("--run-root", required=True, help="where the job writes global_step_N/")
    parser.add_argument("--step", type=int, required=True, help="the step just saved")
    parser.add_argument("--role", default="actor", choices=("actor", "critic", ""), help="actor, critic or '' (SFT)")
    args = parser.parse_args(argv)
    if not args.api_url:
        parser.error("--api-url (or PREFECT_API_URL) is required")
    if args.step < 0:
        parser.error("--step must be >= 0")
    try:
        event_id = notify_checkpoint_saved(args.api_url, args.run_root, args.step, args.role)
    except OSError as exc:
        print(f"verl_notify: event not delivered to {args.api_url}: {exc}", file=sys.stderr)
        return 1
    print(f"sent {EVENT} for {canonical_run_root(args.run_root)} step {args.step}; event {event_id}")
    return 0


if __name__ == "__main__":
    sys.exit(notify_command())
