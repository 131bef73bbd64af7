"""deployments/prefect.yaml, deployed for real with `prefect deploy` against the session's Prefect API.

- merge-step/gpu on the gpu pool with CUDA_VISIBLE_DEVICES set and a concurrency limit; its trigger
  on `stepmerge.checkpoint.saved` is an automation on the server;
- merge-new-steps/watch on the cpu pool with an interval schedule and the watched run root;
- release-adapter/gpu;
- verify-releases/sweep on the cpu pool, daily, over the watched run root's releases (issue 9);
- end to end: `stepmerge notify` emits the event, the server's trigger creates a merge-step/gpu run
  whose parameters (run_root, step as an int, role) pass the flow's own validation.
"""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.params import MergeStepParams, WatchParams
from flows.cli import run_command as stepmerge
from tests.deployments.conftest import WATCHED_RUN_ROOT


def test_pools_schedules_and_job_variables(deployed):
    assert set(deployed) == {"merge-step/gpu", "merge-new-steps/watch", "release-adapter/gpu", "verify-releases/sweep"}
    merge = deployed["merge-step/gpu"]
    assert merge.work_pool_name == "gpu"
    assert merge.job_variables["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert merge.global_concurrency_limit is not None and merge.global_concurrency_limit.limit == 1
    watch = deployed["merge-new-steps/watch"]
    assert watch.work_pool_name == "cpu"
    (schedule,) = watch.schedules
    assert schedule.active and schedule.schedule.interval.total_seconds() == 600
    params = WatchParams(**watch.parameters["params"])
    assert params.run_root == WATCHED_RUN_ROOT and params.merge_deployment == "merge-step/gpu"
    assert deployed["release-adapter/gpu"].work_pool_name == "gpu"
    sweep = deployed["verify-releases/sweep"]  # issue 9: damaged releases are caught on a schedule
    assert sweep.work_pool_name == "cpu" and sweep.schedules[0].schedule.interval.total_seconds() == 86400
    assert sweep.parameters == {"release_root": f"{WATCHED_RUN_ROOT}/releases", "mode": "quick"}
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("gpu")
    assert pool.concurrency_limit == 1


def test_the_trigger_is_an_automation_on_the_saved_event(deployed):
    with get_client(sync_client=True) as client:
        automations = client.request("POST", "/automations/filter", json={}).json()
    merge_id = str(deployed["merge-step/gpu"].id)
    (automation,) = [a for a in automations if any(x.get("deployment_id") == merge_id for x in a["actions"])]
    assert automation["trigger"]["expect"] == ["stepmerge.checkpoint.saved"]
    assert automation["trigger"]["match"] == {"prefect.resource.id": "stepmerge.checkpoint.*"}


def test_notify_from_a_training_job_starts_a_merge_of_that_step(deployed, capsys):
    merge_id = deployed["merge-step/gpu"].id
    assert stepmerge(["notify", "--run-root", "s3://training-bucket/run-42/", "--step", "120"]) == 0
    assert "stepmerge.checkpoint.saved" in capsys.readouterr().out
    deadline = time.monotonic() + 60
    runs = []
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = [r for r in client.read_flow_runs(deployment_filter=DeploymentFilter(
                id=DeploymentFilterId(any_=[merge_id]))) if r.parameters["params"].get("step") == 120]
            if runs:
                break
            time.sleep(0.5)
    (run,) = runs
    assert run.parameters == {"params": {"run_root": "s3://training-bucket/run-42", "step": 120, "role": "actor"}}
    assert MergeStepParams(**run.parameters["params"]).key == "s3://training-bucket/run-42:actor:120"


def test_the_declared_prefect_requirement_matches_the_version_the_code_targets():
    """prefect.yaml and the code target Prefect 3.9 (idempotent deployment runs, trigger templating,
    the events API used here): pyproject.toml must not admit an older Prefect."""
    import re
    import tomllib
    from pathlib import Path

    import yaml
    from packaging.requirements import Requirement
    from packaging.version import Version

    repo = Path(__file__).resolve().parents[2]
    targeted = Version(yaml.safe_load((repo / "deployments" / "prefect.yaml").read_text())["prefect-version"])
    dependencies = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    (prefect,) = [Requirement(d) for d in dependencies if re.match(r"prefect\b", d)]
    oldest = Version(f"{targeted.major}.{targeted.minor}")
    assert oldest in prefect.specifier and Version(f"{targeted.major}.{targeted.minor - 1}.99") not in prefect.specifier
