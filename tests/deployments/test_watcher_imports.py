"""The deployed watcher lists and submits without torch or transformers (issue 11, point 10).

The ``merge-new-steps/watch`` deployment (deployments/prefect.yaml, deployed for real) runs on the
``cpu`` pool: a listings-only job. Two of its flow runs — one over a run root on local disk, one
over a SeaweedFS bucket — are executed in a fresh process exactly as a process worker executes
them (``prefect.flow_engine``: load the flow run, run the deployment's pull step, load the flow
from its entrypoint, run it). Each lists a real verl run (step 1 complete, step 2 missing a rank
file), lists the releases, submits step 1 to ``merge-step/gpu`` and reports step 2 as not ready.
Afterwards neither ``torch`` nor ``transformers`` is in that process's ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey

from flows.step_keys import step_key
from tests.deployments.conftest import REPO
from tests.fixtures_pipeline import copy_steps, rank_file

HEAVY = ("torch", "transformers")
# what a process worker's `python -m prefect.engine` does, for each flow run id given, then the verdict
WORKER = """
import json, sys
from uuid import UUID
from prefect.flow_engine import load_flow, load_flow_run, run_flow

report = []
for run_id in sys.argv[1:]:
    flow_run = load_flow_run(flow_run_id=UUID(run_id))
    outcome = run_flow(load_flow(flow_run), flow_run=flow_run)
    report.append({"actions": [[a.step, a.action] for a in outcome.actions], "waiting": outcome.waiting})
print(json.dumps({"runs": report, "imported": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def test_the_deployed_watcher_imports_neither_torch_nor_transformers(deployed, prefect, template_run, tmp_path,
                                                                       s3_bucket_url):
    roots = [str(tmp_path / "run"), s3_bucket_url + "/run"]
    for root in roots:
        copy_steps(template_run, root, [1, 2], omit=[rank_file(2, 1)])
    watch = deployed["merge-new-steps/watch"]
    with get_client(sync_client=True) as client:
        runs = [client.create_flow_run_from_deployment(watch.id, parameters={"run_root": root}) for root in roots]
    env = dict(os.environ, PREFECT_API_URL=prefect.url, STEPMERGE_HOME=str(REPO), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", WORKER, *(str(r.id) for r in runs)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["imported"] == []
    for root, run in zip(roots, report["runs"]):
        assert run["actions"] == [[1, "submitted"]], root  # listed, planned, submitted as deployed
        assert len(run["waiting"]) == 1 and run["waiting"][0].startswith("2 (actor: model files for ranks [1]")
        with get_client(sync_client=True) as client:
            (merge,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                idempotency_key=FlowRunFilterIdempotencyKey(any_=[step_key(root, "actor", 1)])))
            assert client.read_deployment(merge.deployment_id).name == "gpu"
    with get_client(sync_client=True) as client:
        assert [client.read_flow_run(r.id).state.type.value for r in runs] == ["COMPLETED", "COMPLETED"]
