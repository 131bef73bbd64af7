"""`stepmerge notify` (`flows.cli`): the event reaches the server; bad input and a missing server are clear errors;
the engine does not import Prefect unless this command runs.

A training job trusts the exit code: 0 only when the server accepted the event (the HTTP answer is
checked); a server that cannot be reached, or that refuses the event, is a non-zero exit and no
"emitted" line. The run root is checked like a flow parameter, and a relative local path is sent
as an absolute one (the worker that merges does not share the job's working directory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.events import CHECKPOINT_SAVED, RESOURCE_PREFIX, checkpoint_saved_event
from flows.step_keys import step_key
from flows.cli import run_command as stepmerge
from merge_engine.cli import main as engine_main


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
    code = ("import sys, merge_engine.cli, merge_engine.commands.merge, merge_engine.release.publish, merge_engine.validate; "
            "sys.exit(1 if any(m == 'prefect' or m.startswith('prefect.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_notify_is_the_pipelines_command_and_the_engine_does_not_import_it(capsys):
    """`stepmerge` (flows.cli) is the engine's program plus notify; the engine's own command line has no
    notify and, running any command, loads nothing from flows/ or tasks/ (dependencies point down)."""
    with pytest.raises(SystemExit):
        engine_main(["notify", "--run-root", "s3://b/run", "--step", "1"])
    assert "invalid choice: 'notify'" in capsys.readouterr().err
    code = ("import sys; from merge_engine.cli import main; main(['discover', '--run-root', sys.argv[1]]); "
            "sys.exit(1 if any(m.split('.')[0] in ('flows', 'tasks', 'prefect') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code, "/nonexistent-run"], capture_output=True).returncode == 0


def test_an_unreachable_server_is_a_failure_the_job_can_see(tmp_path):
    """As a training job runs it: a separate process, a server nobody listens on (port 9)."""
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api", PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "notify", "--run-root", "s3://b/run", "--step", "1"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "emitted" not in done.stdout
    assert "127.0.0.1:9" in done.stderr and "not delivered" in done.stderr


def test_a_server_that_refuses_the_event_is_a_failure(prefect_api, capsys):
    with temporary_settings(updates={PREFECT_API_URL: prefect_api.url.rstrip("/") + "/no-such-api"}):
        code = stepmerge(["notify", "--run-root", "s3://b/run", "--step", "2"])
    out, err = capsys.readouterr()
    assert code != 0 and "emitted" not in out
    assert "404" in err


def test_a_relative_run_root_is_sent_as_an_absolute_path(prefect_api, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert stepmerge(["notify", "--run-root", "runs/exp1/", "--step", "3"]) == 0
    run_root = str(tmp_path / "runs" / "exp1")
    (event,) = _events_for(RESOURCE_PREFIX + step_key(run_root, "actor", 3))
    assert event["payload"] == {"run_root": run_root, "step": 3, "role": "actor"}
    assert run_root in capsys.readouterr().out


def test_a_relative_run_root_that_climbs_is_resolved_not_refused(prefect_api, tmp_path, monkeypatch, capsys):
    """Issue 20: ``notify --run_root ../runs/exp1`` (from the job's own folder) was refused as path traversal."""
    (tmp_path / "job").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    assert stepmerge(["notify", "--run_root", "../runs/exp1", "--step", "4"]) == 0
    run_root = str(tmp_path / "runs" / "exp1")
    (event,) = _events_for(RESOURCE_PREFIX + step_key(run_root, "actor", 4))
    assert event["payload"]["run_root"] == run_root


@pytest.mark.parametrize("bad", ["ftp://host/run", "s3://b/run/../other", "s3://", "s3://b/run\\x"])
def test_a_bad_run_root_is_refused_before_anything_is_sent(prefect_api, capsys, bad):
    assert stepmerge(["notify", "--run-root", bad, "--step", "1"]) == 2
    out, err = capsys.readouterr()
    assert "emitted" not in out and err.startswith("stepmerge: error: InvalidOption")
