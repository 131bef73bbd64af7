"""deployments/verl_notify.py: the checkpoint event from a training image with the standard library only.

Run as a training job would (a subprocess that imports nothing of stepmerge, Prefect, pydantic or
torch), it reaches the real server's events API, and the deployed automation starts a merge-step/gpu
run of that step; its event is `stepmerge notify`'s event (one run root spelling, one resource id).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.events import checkpoint_saved_event as stepmerge_event
from tests.deployments.conftest import REPO

JOB = """
import sys
sys.path.insert(0, sys.argv[1])
import verl_notify
rc = verl_notify.notify_command(["--api-url", sys.argv[2], "--run-root", "s3://training-bucket/verl-run/", "--step", "130"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "flows", "merge_engine", "torch", "pydantic",
                                                          "httpx", "fsspec"})
print("HEAVY", heavy)
sys.exit(rc)
"""


def test_a_training_job_with_only_the_standard_library_starts_a_merge(deployed, prefect_api):
    done = subprocess.run([sys.executable, "-I", "-c", JOB, str(REPO / "deployments"), prefect_api.url],
                          capture_output=True, text=True, timeout=120, env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout
    merge_id = deployed["merge-step/gpu"].id
    deadline, runs = time.monotonic() + 60, []
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline and not runs:
            runs = [r for r in client.read_flow_runs(deployment_filter=DeploymentFilter(
                id=DeploymentFilterId(any_=[merge_id]))) if r.parameters.get("step") == 130]
            time.sleep(0.5)
    (run,) = runs
    assert run.parameters == {"run_root": "s3://training-bucket/verl-run", "step": 130, "role": "actor"}


def test_not_delivered_is_exit_1_in_one_line():
    done = subprocess.run([sys.executable, "-I", str(REPO / "deployments" / "verl_notify.py"), "--api-url",
                           "http://127.0.0.1:9/api", "--run-root", "s3://b/run", "--step", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("verl_notify: event not delivered to http://127.0.0.1:9/api")
    assert "Traceback" not in done.stderr


def test_the_same_event_as_stepmerge_notify():
    sys.path.insert(0, str(REPO / "deployments"))
    try:
        import verl_notify
    finally:
        sys.path.pop(0)
    for run_root in ("s3://b/run/", "file:///shared/run", "/shared/run", "gcs://b/run"):
        ours = verl_notify.saved_event_json(run_root, 7, "critic")
        theirs = stepmerge_event(run_root, 7, "critic")
        assert {k: ours[k] for k in theirs} == theirs
        assert set(ours) - set(theirs) == {"id", "occurred"}  # what POST /api/events requires besides
