"""The deployments of deployments/prefect.yaml, created once per session with the real `prefect deploy`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WATCHED_RUN_ROOT = "s3://stepmerge-watched/run"


@pytest.fixture(scope="session")
def deployed(prefect_api):
    """Work pools gpu and cpu (concurrency limit 1), then `python -m deployments.deploy` (what `make deploy`
    runs: `prefect deploy --all` of deployments/prefect.yaml, then the watcher's first run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()  # what `prefect work-pool create --type process` sets
    with get_client(sync_client=True) as client:
        for name in ("gpu", "cpu"):
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=1,
                                                   base_job_template=template), overwrite=True)
    env = dict(os.environ, PREFECT_API_URL=prefect_api.url, STEPMERGE_HOME=str(REPO),
               STEPMERGE_RUN_ROOT=WATCHED_RUN_ROOT, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "deployments.deploy"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "merge-new-steps/watch watches s3://stepmerge-watched/run every 600 s, first run now" in done.stdout
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments()
    # prefect.yaml's deployments (other tests of the session add watchers of their own run roots)
    return {f"{d.entrypoint.rsplit(':', 1)[1].replace('_', '-')}/{d.name}": d for d in deployments
            if d.entrypoint and d.name in ("gpu", "watch", "sweep")}
