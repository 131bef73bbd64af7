"""`stepmerge notify`: the event reaches the server; bad input and a missing server are clear errors;
the engine does not import Prefect unless this command runs."""

from __future__ import annotations

import subprocess
import sys
import time

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.events import CHECKPOINT_SAVED, checkpoint_saved_event
from merge_engine.cli import main as stepmerge


def _events_for(resource_id: str, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            body = {"filter": {"event": {"name": [CHECKPOINT_SAVED]}, "resource": {"id": [resource_id]}}}
            events = client.request("POST", "/events/filter", json=body).json()["events"]
            if events:
                return events
            time.sleep(0.5)
    return []


def test_notify_emits_the_checkpoint_saved_event(prefect_api, capsys):
    assert stepmerge(["notify", "--run-root", "gs://bucket/sft-run", "--step", "7", "--role", ""]) == 0
    expected = checkpoint_saved_event("gs://bucket/sft-run", 7, "")
    (event,) = _events_for(expected["resource"]["prefect.resource.id"])
    assert event["payload"] == {"run_root": "gs://bucket/sft-run", "step": 7, "role": ""}
    assert event["resource"]["stepmerge.run_root"] == "gs://bucket/sft-run"
    assert "event " in capsys.readouterr().out


def test_bad_input_and_no_server_are_one_line_errors(prefect_api, capsys):
    assert stepmerge(["notify", "--run-root", "s3://b/run", "--step", "-1"]) == 2
    assert "--step must be >= 0" in capsys.readouterr().err
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert stepmerge(["notify", "--run-root", "s3://b/run", "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stepmerge: error: InvalidOption") and "PREFECT_API_URL" in err


def test_the_engine_does_not_import_prefect():
    code = ("import sys, merge_engine.cli, merge_engine.merge, merge_engine.publish, merge_engine.validate; "
            "sys.exit(1 if any(m == 'prefect' or m.startswith('prefect.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
