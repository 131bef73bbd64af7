"""End to end as an operator runs it: ``prefect server start``, the two work pools, ``make deploy``
(`python -m deployments.deploy`), a ``prefect worker start`` per pool.

- the watcher's SCHEDULE fires (a run the server's scheduler made, not one asked for: its interval is
  prefect.yaml's 600 s, its next tick moved to now), a ``cpu`` worker runs it, it submits the step (written
  after the deploy's own first watcher run ended, so only the tick can submit it: the step's run is a subflow
  of the scheduled run), and a ``gpu`` worker runs the ``merge-step/gpu`` run it submitted; the release is judged
  from outside
  (`tests.release_checks`: the safetensors library against the weights the synthetic checkpoint was
  written from, bit for bit);
- a cancel (``prefect flow-run cancel``'s request) while a ``merge-step/gpu`` run is merging (held there: the store stalls its
  merge reads, never its check's) ends it Cancelled, with no release without its marker and nothing a
  reader could take for a model in staging; the next run of the step publishes the exact weights.

Every wait is for a state read from the API (or the files), bounded by a deadline that only stops a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from deployments.ui_check import free_port, stop
from tests.fault_proxy import Fault, FaultProxy
from tests.fixtures_pipeline import copy_steps
from tests.release_checks import _files, assert_release_weights_equal

REPO = Path(__file__).resolve().parents[2]
# bounds a hang only: every wait below ends on a state. A worker starts Python, Prefect and torch and merges; at
# load average 150 (three suites and a CPU hog on 2 cores) one such wait took over 240 s; quiet, the test is ~60 s
HANG_S = 900.0
MERGE_READ_STALL_AFTER = 150_000  # bytes on one connection: more than the check reads, less than a rank file


def _until(condition, what: str, hang_s: float = HANG_S, poll_s: float = 0.5):
    deadline = time.monotonic() + hang_s
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"still not {what} after {hang_s:.0f} s"
        time.sleep(poll_s)


class Operator:
    """A Prefect server, its pools, the deployments of prefect.yaml and one worker per pool."""

    def __init__(self, home: Path, run_root: Path, s3_env: dict[str, str], proxy: FaultProxy) -> None:
        self.home, self.run_root, self.proxy = home, run_root, proxy
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.staging = home / "staging"
        self.env = {**os.environ, "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": self.api, "PYTHONPATH": str(REPO),
                    "STEPMERGE_HOME": str(REPO), "STEPMERGE_RUN_ROOT": str(run_root),
                    "PREFECT_LOGGING_LEVEL": "WARNING"}
        for key in ("PREFECT_PROFILES_PATH", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "STEPMERGE_LOCK_DIR"):
            self.env.pop(key, None)  # the session's own harness settings: this server has its own home
        # the GPU worker's own settings (deployments/README.md): staging, devices, and the store it reads
        self.worker_env = {**self.env, **s3_env, "STEPMERGE_S3_ENDPOINT": proxy.url, "AWS_ENDPOINT_URL": proxy.url,
                           "STEPMERGE_STAGING_DIR": str(self.staging), "CUDA_VISIBLE_DEVICES": "",
                           "STEPMERGE_READ_AHEAD_BYTES": "0", "PREFECT_WORKER_QUERY_SECONDS": "1"}
        self.processes: list[tuple[str, subprocess.Popen, int]] = []
        self.logs = home / "logs"
        self.logs.mkdir()

    def start(self, name: str, argv: list[str], env: dict[str, str], stop_with: int) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "prefect", *argv], env=env, cwd=REPO,
                                   stdout=open(self.logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        self.processes.append((name, process, stop_with))
        return process

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api)

    def healthy(self) -> bool:
        try:
            with self.client() as client:
                return client.api_healthcheck() is None
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def close(self) -> None:
        """Stop the workers, all at once, then the server. A worker (SIGINT: it ignores SIGTERM) is asked with one
        SIGINT and insisted on with more once its log says it took the first: its handler then sends itself
        SIGKILL (deployments/README.md); no run is left running by then, so there is nothing to give time to."""
        workers = [(name, process) for name, process, signum in self.processes if signum == signal.SIGINT]
        for _, process in workers:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)

        def stopped() -> bool:
            for name, process in workers:
                # a SIGINT that arrives before the first one's handler has armed the SIGKILL goes to Prefect's
                # own handler instead (or merges with the first): so one more on each look until it is gone
                if process.poll() is None and "Received SIGINT" in (self.logs / f"{name}.log").read_text():
                    process.send_signal(signal.SIGINT)
            return all(process.poll() is not None for _, process in workers)

        try:
            _until(stopped, "every worker stopped", poll_s=0.2)
        finally:
            for name, process, signum in reversed(self.processes):
                stop(process, signum)  # the server (SIGTERM); a worker only if the wait above did not end

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def operator(tmp_path_factory, template_run, s3_server):
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    home = tmp_path_factory.mktemp("operator")
    run_root = home / "run"
    run_root.mkdir()  # no step yet: the schedule test writes step 1 once the deploy's own watcher run has ended
    with FaultProxy(s3_server.port) as proxy:
        op = Operator(home, run_root, s3_server.env(), proxy)
        try:
            # the scheduler looks every second (its default, 60 s, only delays the first scheduled run)
            op.start("server", ["server", "start", "--host", "127.0.0.1", "--port", str(op.port)],
                     {**op.env, "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1"}, signal.SIGTERM)
            _until(op.healthy, "the Prefect server answering")
            with op.client() as client:  # `prefect work-pool create <pool> --type process`, without a CLI process
                for pool in ("gpu", "cpu"):
                    client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                           base_job_template=ProcessWorker.get_default_base_job_template()))
            done = subprocess.run([sys.executable, "-m", "deployments.deploy"], env=op.env, cwd=REPO,
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            for pool in ("cpu", "gpu"):
                op.start(f"worker-{pool}", ["worker", "start", "--pool", pool, "--name", f"operator-{pool}"],
                         op.worker_env, signal.SIGINT)
            yield op
        finally:
            op.close()


def _deployment(client, name: str):
    return client.read_deployment_by_name(name)


def _runs(client, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def _final(op: Operator, run_id, what: str):
    def finished():
        with op.client() as client:
            run = client.read_flow_run(run_id)
        return run if run.state is not None and run.state.is_final() else None

    return _until(finished, f"{what} finished")


def test_the_schedule_fires_and_workers_of_the_pools_merge_and_publish_the_exact_weights(operator, template_run):
    from prefect.client.schemas.schedules import IntervalSchedule

    op = operator
    with op.client() as client:
        watch = _deployment(client, "merge-new-steps/watch")
        merge = _deployment(client, "merge-step/gpu")
        (schedule,) = client.read_deployment_schedules(watch.id)
    assert schedule.active and schedule.schedule.interval == timedelta(seconds=600)  # prefect.yaml's
    # the deploy's own first run ("first run now", `deployments.deploy`) holds the deployment's one concurrency slot
    # while it runs: a scheduled run due meanwhile waits for the slot, and Prefect looks again only 30 s later
    with op.client() as client:
        deployed = [run for run in _runs(client, watch.id) if not run.auto_scheduled]
    assert deployed, "the deploy made no first run of the watcher"
    for run in deployed:
        _final(op, run.id, "the deploy's first watcher run")

    def step_run():
        with op.client() as client:
            return [r for r in _runs(client, merge.id) if r.parameters.get("step") == 1]

    assert step_run() == []  # nothing to submit yet; the step appears now, for the tick alone
    copy_steps(template_run, str(op.run_root), [1])

    def scheduled_at(tick: datetime) -> list:
        with op.client() as client:
            return [r for r in _runs(client, watch.id)
                    if r.auto_scheduled and abs((r.expected_start_time - tick).total_seconds()) < 1]

    lead = 3.0
    while True:  # the same schedule, its next tick moved to now + lead: a tick the scheduler only saw after
        tick = datetime.now(timezone.utc) + timedelta(seconds=lead)  # it had passed is never run; move it again
        with op.client() as client:
            client.update_deployment_schedule(watch.id, schedule.id, schedule=IntervalSchedule(
                interval=timedelta(seconds=600), anchor_date=tick))
        runs = _until(lambda: scheduled_at(tick) or datetime.now(timezone.utc) > tick + timedelta(seconds=5),
                      "the scheduler's run at the moved tick, or the tick passed", poll_s=0.2)
        if runs is not True:
            break
        assert lead < 60, "the scheduler never made a run at a tick a minute ahead"
        lead *= 2
    fired = _final(op, runs[0].id, "the scheduled watcher run")
    assert fired.state.is_completed(), (fired.state, op.log("worker-cpu"))
    assert fired.work_pool_name == "cpu" and fired.infrastructure_pid, fired

    submitted = step_run()  # the tick has ended: its submission is there now, or it made none
    assert len(submitted) == 1, f"the scheduled watcher run submitted {len(submitted)} runs of step 1"
    (submitted,) = submitted
    with op.client() as client:  # a subflow of the scheduled run (`run_deployment(as_subflow=True)`)
        parent = client.read_task_run(submitted.parent_task_run_id) if submitted.parent_task_run_id else None
    assert parent is not None and parent.flow_run_id == fired.id, \
        f"step 1's run {submitted.id} has parent task run {submitted.parent_task_run_id}, not one of {fired.id}"
    merged = _final(op, submitted.id, "the merge of step 1")
    assert merged.state.is_completed(), (merged.state, op.log("worker-gpu"))
    assert merged.work_pool_name == "gpu" and merged.infrastructure_pid, merged  # started by a worker of its pool
    with op.client() as client:
        assert [w.name for w in client.read_workers_for_work_pool("gpu")] == ["operator-gpu"]

    release = str(op.run_root / "releases" / "actor" / "global_step_1")
    assert os.path.isfile(os.path.join(release, "_COMPLETE"))
    assert_release_weights_equal(release, template_run.reference_weights(1))


def test_a_cancel_mid_merge_leaves_nothing_unmarked_and_the_next_run_publishes(operator, template_run, s3_env,
                                                                               s3_bucket_url):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import State, StateType
    from prefect.client.schemas.responses import SetStateStatus

    op = operator
    run_root = f"{s3_bucket_url}/cancelled-run"
    copy_steps(template_run, run_root, [2])
    release = f"{run_root}/releases/actor/global_step_2"
    # every new connection to the store stalls after MERGE_READ_STALL_AFTER bytes: the check's small reads
    # pass, a merge read of rank-file data waits (a timed-out read retries on a new connection: it stalls too)
    op.proxy.set_fault(Fault.stall(3600, after_bytes=MERGE_READ_STALL_AFTER, connections=10_000))
    try:
        with op.client() as client:
            merge = _deployment(client, "merge-step/gpu")
            run = client.create_flow_run_from_deployment(merge.id, parameters={"run_root": run_root, "step": 2})

        def merging():
            with op.client() as client:
                tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            return op.proxy.fired > 0 and any(t.name.startswith("merge-model") and t.state.is_running() for t in tasks)

        _until(merging, "the merge of step 2 held mid-read")
        with op.client() as client:  # what `prefect flow-run cancel <id>` does, without a CLI process to start
            answer = client.set_flow_run_state(run.id, State(type=StateType.CANCELLING))
        assert answer.status == SetStateStatus.ACCEPT, answer
        cancelled = _final(op, run.id, "the cancelled merge")
        assert cancelled.state.is_cancelled(), (cancelled.state, op.log("worker-gpu"))
    finally:
        op.proxy.set_fault(None)  # closes the stalled connections too

    left = _files(release)
    assert not left or "_COMPLETE" in left, f"a release without its marker: {sorted(left)}"
    visible = [p for p in op.staging.rglob("*") if p.is_file()
               and not any(part.startswith(".") for part in p.relative_to(op.staging).parts)]
    assert visible == [], f"staging a reader could take for a model: {visible}"

    with op.client() as client:
        again = client.create_flow_run_from_deployment(merge.id, parameters={"run_root": run_root, "step": 2})
    rerun = _final(op, again.id, "the merge of step 2 run again")
    assert rerun.state.is_completed(), (rerun.state, op.log("worker-gpu"))
    assert "_COMPLETE" in _files(release)
    assert_release_weights_equal(release, template_run.reference_weights(2))
