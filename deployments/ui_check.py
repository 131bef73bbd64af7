"""``make ui-check``: the real Prefect UI, driven by a real headless browser, merges a step.

1. starts ``prefect server start`` (its own PREFECT_HOME in a temp folder, a free port);
2. writes a small verl run (2-rank FSDP2, one step) with real ``torch.distributed``;
3. creates the ``gpu`` and ``cpu`` work pools, deploys with ``python -m deployments.deploy``
   (the watcher's first run waits on the ``cpu`` pool, which gets no worker here), and starts a
   ``gpu`` process worker;
4. opens ``merge-step/gpu``'s run form in Debian's ``chromium`` driven by Playwright
   (``executable_path=/usr/bin/chromium``: Playwright's own browser download is not used), fills
   ``step``, screenshots the form, submits;
5. waits for the flow run to end Completed, then screenshots the run page and the rendered summary
   artifact.

Screenshots go to ``ui-check/`` (``form.png``, ``run.png``, ``summary.png``). Not part of ``make
test``: it needs chromium and takes a minute or two. Exit status 0 only when the run completed and
every screenshot was written; otherwise one line says what failed.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("STEPMERGE_CHROMIUM", "/usr/bin/chromium")
STEP = 1
SERVER_START_S = 180
RUN_TIMEOUT_S = 900


class UiCheckFailed(Exception):
    """What went wrong, in one line."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout_s: float, what: str, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise UiCheckFailed(f"{what} did not happen within {timeout_s:.0f} s")


def healthy(api_url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(api_url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def write_run(run_root: Path) -> None:
    from synthetic_runs.fsdp import FsdpSpec, StepJob, write_fsdp_steps

    write_fsdp_steps([StepJob(str(run_root / f"global_step_{STEP}"), FsdpSpec(world_size=2, strategy="fsdp2"), STEP)])
    (run_root / "latest_checkpointed_iteration.txt").write_text(str(STEP))


def run_checked(command, env: Dict[str, str], what: str) -> None:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = " | ".join([line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:])
        raise UiCheckFailed(f"{what} failed: {tail}")


def browse(base: str, deployment_id: str, out: Path, api_env: Dict[str, str]) -> str:
    """Fill and submit the run form; wait for the run; screenshots. Returns the flow run id."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(f"{base}/deployments/deployment/{deployment_id}/run", wait_until="networkidle", timeout=120_000)
        step_field = page.locator(".schema-form-property").filter(
            has=page.locator(".schema-form-property__label", has_text="step")).first
        step_input = step_field.locator("input").first
        step_input.wait_for(timeout=120_000)
        step_input.fill(str(STEP))
        page.screenshot(path=str(out / "form.png"), full_page=True)
        before = run_ids(deployment_id, api_env)
        page.get_by_role("button", name="Submit").click()
        (flow_run_id,) = wait_for(lambda: run_ids(deployment_id, api_env) - before, 120, "the run's creation")
        state = wait_for(lambda: final_state(flow_run_id, api_env), RUN_TIMEOUT_S, "the flow run's end", 3.0)
        if state != "COMPLETED":
            page.screenshot(path=str(out / "run.png"), full_page=True)
            raise UiCheckFailed(f"flow run {flow_run_id} ended {state} (see ui-check/run.png and the worker log)")
        page.goto(f"{base}/runs/flow-run/{flow_run_id}", wait_until="networkidle", timeout=120_000)
        page.get_by_text("Completed").first.wait_for(timeout=60_000)
        page.screenshot(path=str(out / "run.png"), full_page=True)
        artifact_id = summary_artifact(flow_run_id, api_env)
        page.goto(f"{base}/artifacts/artifact/{artifact_id}", wait_until="networkidle", timeout=120_000)
        page.get_by_text(f"Step {STEP} of").first.wait_for(timeout=60_000)
        page.screenshot(path=str(out / "summary.png"), full_page=True)
        browser.close()
    return flow_run_id


def _client(api_env: Dict[str, str]):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: api_env["PREFECT_API_URL"]}), get_client


def final_state(flow_run_id: str, api_env: Dict[str, str]) -> Optional[str]:
    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    state = str(run.state.type.value) if run.state else "SCHEDULED"
    return state if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None


def summary_artifact(flow_run_id: str, api_env: Dict[str, str]) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    summaries = [a for a in artifacts if a.type == "markdown" and str(a.key or "").startswith("merge-")]
    if not summaries:
        raise UiCheckFailed(f"flow run {flow_run_id} left no summary artifact")
    return str(summaries[0].id)


def run_ids(deployment: str, api_env: Dict[str, str]) -> set:
    """The ids of the deployment's flow runs."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment])))
    return {str(r.id) for r in runs}


def deployment_id(api_env: Dict[str, str]) -> str:
    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        return str(client.read_deployment_by_name("merge-step/gpu").id)


def stop(process: Optional[subprocess.Popen], first: int, again_after_s: Optional[float] = None) -> None:
    """Stop ``process`` with ``first``; with ``again_after_s``, send it once more after that long (a Prefect
    worker lingers for minutes after one SIGINT and stops on the second: deployments/README.md)."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(first)
    try:
        process.wait(timeout=again_after_s or 30)
        return
    except subprocess.TimeoutExpired:
        if again_after_s is not None:
            process.send_signal(first)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def check(out: Path) -> str:
    work = Path(tempfile.mkdtemp(prefix="stepmerge-ui-check-"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_HOME=str(work / "prefect"),
               PREFECT_API_URL=api, PREFECT_UI_API_URL=api, PYTHONPATH=str(REPO), STEPMERGE_HOME=str(REPO),
               STEPMERGE_RUN_ROOT=str(work / "run"))
    python = sys.executable
    server = worker = None
    logs = work / "logs"
    logs.mkdir()
    try:
        started = time.perf_counter()
        server = subprocess.Popen([python, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                   str(port)], env=env, stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT)
        wait_for(lambda: healthy(api), SERVER_START_S, "the Prefect server's start")
        print(f"== prefect server on {api} ({time.perf_counter() - started:.1f} s)", flush=True)
        write_run(work / "run")
        print(f"== demo run written to {work / 'run'}", flush=True)
        for pool in ("gpu", "cpu"):
            run_checked([python, "-m", "prefect", "work-pool", "create", pool, "--type", "process"], env,
                        f"creating the {pool} pool")
        run_checked([python, "-m", "deployments.deploy"], env, "python -m deployments.deploy")
        print("== deployed", flush=True)
        worker_env = dict(env, STEPMERGE_STAGING_DIR=str(work / "staging"), CUDA_VISIBLE_DEVICES="")
        worker = subprocess.Popen([python, "-m", "prefect", "worker", "start", "--pool", "gpu", "--name",
                                   "ui-check-gpu"], env=worker_env, stdout=open(logs / "worker.log", "w"),
                                  stderr=subprocess.STDOUT)
        started = time.perf_counter()
        flow_run_id = browse(api[: -len("/api")], deployment_id(env), out, env)
        print(f"== flow run {flow_run_id} submitted from the form and Completed "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
        return flow_run_id
    finally:
        stop(worker, signal.SIGINT, again_after_s=5)
        stop(server, signal.SIGTERM)
        print(f"   logs: {kept_logs(work, logs, out)}")


def kept_logs(work: Path, logs: Path, out: Path) -> Path:
    """Copy ``logs`` to ``out/logs`` (beside the screenshots) and remove the temp folder ``work`` (the
    server's database, the run, staging): `make ui-check` leaves nothing in the temp dir."""
    kept = out / "logs"
    if logs.is_dir():
        shutil.copytree(logs, kept, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return kept


def run_ui_check() -> int:
    out = Path("ui-check").resolve()
    out.mkdir(exist_ok=True)
    try:
        check(out)
    except UiCheckFailed as exc:
        print(f"ui-check: {exc}", file=sys.stderr)
        return 1
    missing = [name for name in ("form.png", "run.png", "summary.png") if not (out / name).is_file()]
    if missing:
        print(f"ui-check: screenshots missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"== screenshots: {out}/form.png, run.png, summary.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_ui_check())
