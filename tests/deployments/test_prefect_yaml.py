"""deployments/prefect.yaml, deployed for real (`python -m deployments.deploy`) against the session's Prefect API.

- merge-step/gpu on the gpu pool with a concurrency limit and NO environment of its own (GPU and
  staging are the worker's: a deployment's job_variables env would override the worker's); its
  trigger on `stepmerge.checkpoint.saved` is a NAMED automation on the server;
- merge-new-steps/watch on the cpu pool with an interval schedule, the watched run root, and a first
  run created at deploy time (not one interval later); another watcher is one documented command;
- release-adapter/gpu;
- verify-releases/sweep on the cpu pool, daily, over the watched run root's releases (issue 9);
- the server refuses bad parameters before a run exists; `--param step=N` alone is a valid run;
- deploying without STEPMERGE_HOME / STEPMERGE_RUN_ROOT fails at deploy time, saying which;
- end to end: `stepmerge notify` emits the event, the server's trigger creates a merge-step/gpu run
  whose flat parameters (run_root, step as an int, role) pass the flow's own validation.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.params import MergeStepParams, WatchParams
from flows.cli import run_command as stepmerge
from tests.deployments.conftest import REPO, WATCHED_RUN_ROOT


def test_pools_schedules_and_job_variables(deployed):
    assert set(deployed) == {"merge-step/gpu", "merge-new-steps/watch", "release-adapter/gpu", "verify-releases/sweep"}
    merge = deployed["merge-step/gpu"]
    assert merge.work_pool_name == "gpu"
    assert "env" not in (merge.job_variables or {})  # the worker's CUDA_VISIBLE_DEVICES / staging dir win
    assert merge.global_concurrency_limit is not None and merge.global_concurrency_limit.limit == 1
    watch = deployed["merge-new-steps/watch"]
    assert watch.work_pool_name == "cpu"
    (schedule,) = watch.schedules
    assert schedule.active and schedule.schedule.interval.total_seconds() == 600
    params = WatchParams(**watch.parameters)
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
    assert automation["name"] == "stepmerge: merge a saved checkpoint"  # was "gpu__automation_1"
    assert automation["trigger"]["expect"] == ["stepmerge.checkpoint.saved"]
    assert automation["trigger"]["match"] == {"prefect.resource.id": "stepmerge.checkpoint.*"}


def test_notify_from_a_training_job_starts_a_merge_of_that_step(deployed, capsys):
    merge_id = deployed["merge-step/gpu"].id
    assert stepmerge(["notify", "--run-root", "s3://training-bucket/run-42/", "--step", "120"]) == 0
    assert "stepmerge.checkpoint.saved" in capsys.readouterr().out
    # wait for the state (the automation's run), over every page of the deployment's runs: the session's
    # other tests create many runs of merge-step/gpu, and under load the trigger takes its time
    deadline = time.monotonic() + 240
    runs = []
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = [r for r in _runs_of(client, merge_id) if r.parameters.get("step") == 120]
            if runs:
                break
            time.sleep(0.5)
    (run,) = runs
    assert run.parameters == {"run_root": "s3://training-bucket/run-42", "step": 120, "role": "actor"}
    assert MergeStepParams(**run.parameters).key == "s3://training-bucket/run-42:actor:120"


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


def _runs_of(client, deployment_id, page: int = 200) -> list:
    """Every run of the deployment: all pages (one page is ``page`` runs; the session makes more)."""
    runs: list = []
    while True:
        batch = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                      limit=page, offset=len(runs))
        runs += batch
        if len(batch) < page:
            return runs


def test_gpu_and_staging_settings_are_the_workers(deployed, monkeypatch):
    """What a `gpu` process worker started with ``CUDA_VISIBLE_DEVICES=1`` gives a merge run: the job
    configuration Prefect's own process worker builds from the pool's template and the deployment."""
    from prefect.workers.process import ProcessJobConfiguration

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("STEPMERGE_STAGING_DIR", "/scratch/second-gpu")
    merge = deployed["merge-step/gpu"]
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("gpu")
        flow_run = client.create_flow_run_from_deployment(merge.id, parameters={"step": 1})
        flow = client.read_flow(merge.flow_id)
    configuration = asyncio.run(ProcessJobConfiguration.from_template_and_values(pool.base_job_template,
                                                                                 merge.job_variables))
    configuration.prepare_for_flow_run(flow_run, deployment=merge, flow=flow)
    assert configuration.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert configuration.env["STEPMERGE_STAGING_DIR"] == "/scratch/second-gpu"


def test_the_watcher_runs_at_deploy_time(deployed):
    """Its schedule's first run is 600 s after the deploy; `deployments.deploy` adds one at once: a run
    expected well before the schedule's first slot (half an interval: the deploy of the other deployments
    in between takes a minute or more on a loaded machine) is that one."""
    watch = deployed["merge-new-steps/watch"]
    with get_client(sync_client=True) as client:
        runs = _runs_of(client, watch.id)
    interval = watch.schedules[0].schedule.interval
    assert min(r.expected_start_time for r in runs) <= watch.created + interval / 2


BAD_VALUES = [{"run_root": "ftp://host/run"}, {"run_root": "s3://bucket/run/../../other"},
              {"run_root": "s3://bucket/%2e%2e/x"}, {"run_root": "/data/../etc"}, {"max_shard_size": "lots"},
              {"step": -1}, {"dtype": "fp17"}, {"role": "ref"}, {"release_root": "http://evil/x"},
              {"weights_format": "gguf"},
              {"stpe": 11}, {"run-root": "s3://bucket/run"}, {"params": {"step": 11}}]  # unknown names
# (unknown names: `deployments.deploy` closes each schema, additionalProperties false; a bare `prefect
# deploy` leaves it open, and the flow refuses them when the run starts, tests/flows/test_params.py)


def test_a_step_number_alone_starts_a_merge_and_bad_values_never_make_a_run(deployed):
    """`prefect deployment run 'merge-step/gpu' --param step=10`; the server checks every value first
    (these reached the gpu worker and failed there 20 s later, holding the pool's only slot)."""
    merge = deployed["merge-step/gpu"]
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(merge.id, parameters={"step": 10})
        assert MergeStepParams(**{**merge.parameters, **run.parameters}).key == f"{WATCHED_RUN_ROOT}:actor:10"
        for bad in BAD_VALUES:
            with pytest.raises(Exception) as refused:
                client.create_flow_run_from_deployment(merge.id, parameters={"step": 10, **bad})
            assert "409" in str(refused.value) or "Validation failed" in str(refused.value), (bad, refused.value)
        # no run holds a bad value (counting all runs flaked: the trigger creates runs for other tests' events)
        made = [r.parameters for r in _runs_of(client, merge.id)]
        assert not [bad for bad in BAD_VALUES if any(all(p.get(k) == v for k, v in bad.items()) for p in made)]
        with pytest.raises(Exception, match="'stpe' was unexpected"):
            client.create_flow_run_from_deployment(merge.id, parameters={"step": 10, "stpe": 11})
    for name in ("merge-new-steps/watch", "release-adapter/gpu", "verify-releases/sweep"):
        assert deployed[name].parameter_openapi_schema["additionalProperties"] is False, name


@pytest.mark.parametrize("missing", ["STEPMERGE_HOME", "STEPMERGE_RUN_ROOT"])
def test_deploying_without_the_environment_fails_at_deploy_time(prefect_api, missing):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPMERGE_")}
    env.update(PREFECT_API_URL=prefect_api.url, STEPMERGE_HOME=str(REPO), STEPMERGE_RUN_ROOT=WATCHED_RUN_ROOT,
               PYTHONPATH=str(REPO))
    del env[missing]
    if missing == "STEPMERGE_RUN_ROOT":  # the build step's last check: the bare command runs it (15 s a deploy)
        bare = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                               "deployments/prefect.yaml"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert bare.returncode != 0 and f"stepmerge: set {missing}" in bare.stdout + bare.stderr
    wrapped = subprocess.run([sys.executable, "-m", "deployments.deploy"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
    assert wrapped.returncode == 2 and "Traceback" not in wrapped.stderr
    assert wrapped.stderr.strip().startswith(f"stepmerge deploy: set {missing} ")


def test_another_watcher_is_one_command(deployed, prefect_api):
    env = dict(os.environ, PREFECT_API_URL=prefect_api.url, STEPMERGE_HOME=str(REPO), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "deployments.deploy", "--watcher", "watch-exp2", "--run-root",
                           "s3://stepmerge-watched/exp2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with get_client(sync_client=True) as client:
        second = client.read_deployment_by_name("merge-new-steps/watch-exp2")
        runs = _runs_of(client, second.id)
    first = deployed["merge-new-steps/watch"]
    assert second.parameters["run_root"] == "s3://stepmerge-watched/exp2"
    assert second.parameter_openapi_schema["additionalProperties"] is False
    assert (second.work_pool_name, second.pull_steps) == (first.work_pool_name, first.pull_steps)
    assert second.schedules[0].schedule.interval == first.schedules[0].schedule.interval
    assert any(r.expected_start_time <= second.created + second.schedules[0].schedule.interval / 2 for r in runs)
