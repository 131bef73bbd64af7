"""``make ui-check``: the real Prefect UI, driven by a real headless browser, merges a step.

1. starts ``prefect server start`` (its own PREFECT_HOME in a temp folder, a free port);
2. writes a small verl run with real ``torch.distributed``: step 1 complete (2-rank FSDP2), step 2
   still being written (rank 1's model file missing);
3. creates the ``gpu`` and ``cpu`` work pools, deploys with ``python -m deployments.deploy``
   (the watcher's first run waits on the ``cpu`` pool, which gets no worker here), and starts a
   ``gpu`` process worker;
4. opens ``merge-step/gpu``'s run form in Debian's ``chromium`` driven by Playwright
   (``executable_path=/usr/bin/chromium``: Playwright's own browser download is not used), fills
   ``step``; submits a bad ``run_root`` once (refused in words under the field, no run made); opens
   the ``dtype`` dropdown; submits the form;
5. once it has Completed, runs the deployment for step 2 (not ready), then for a step that is not there;
6. screenshots each run's page, the summary artifact and the run list.

Screenshots go to ``ui-check/`` (`SCREENSHOTS`: what each must show); the two README shows (the run form and
the run's summary) are also written, scaled down, to ``docs/images/`` (`README_IMAGES`), so a run refreshes them. Before each, the page is
checked for the text that proves it (the state name, the tag, the error, the dropdown's choices),
so a screenshot that exists shows what it should. Not part of ``make test``: it needs chromium and
takes a few minutes. Exit status 0 only when every run ended as expected and every screenshot was
written; otherwise one line says what failed.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("STEPMERGE_CHROMIUM", "/usr/bin/chromium")
STEP = 1
NOT_READY_STEP = 2  # written without rank 1's model file: still being written
MISSING_STEP = 99  # not there: StepNotFound, a Failed run
BAD_RUN_ROOT = "ftp://host/run"
SERVER_START_S = 180
RUN_TIMEOUT_S = 900
WIDTH, HEIGHT, TALL = 1600, 1000, 1700  # the browser's window; TALL: a whole form, run page or run list
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = {
    "form.png": "merge-step/gpu's run form, step filled in",
    "refusal.png": f"the form refusing run_root={BAD_RUN_ROOT} in words under the field (no run made)",
    "dtype.png": "the dtype dropdown open: 'as stored' (selected) first, then the dtype spellings",
    "run.png": f"the form's run (step {STEP}) Completed",
    "summary.png": "its summary artifact",
    "not-ready.png": f"step {NOT_READY_STEP} (still being written): the state NotReady, the tag not-ready",
    "failed.png": f"step {MISSING_STEP} (not there): Failed, StepNotFound in one log line, no traceback",
    "runs.png": "the run list: Completed, NotReady and Failed side by side",
}

README_IMAGES = {"form.png": "docs/images/run-form.png", "summary.png": "docs/images/run-summary.png"}
README_IMAGE_WIDTH, README_IMAGE_HEIGHT = 1000, 1100  # the top of each page, scaled down
README_IMAGE_BYTES = 300_000  # small enough to keep in git


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
    writing = run_root / f"global_step_{NOT_READY_STEP}"
    shutil.copytree(run_root / f"global_step_{STEP}", writing)
    (writing / "actor" / "model_world_size_2_rank_1.pt").unlink()  # rank 1 has not finished yet


def run_checked(command, env: Dict[str, str], what: str) -> None:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = " | ".join([line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:])
        raise UiCheckFailed(f"{what} failed: {tail}")


def form_field(page, name: str):
    """The run form's control group for parameter ``name`` (its label is ``name`` or ``name (Optional)``)."""
    label = page.locator(".schema-form-property__label", has_text=re.compile(rf"^{re.escape(name)}( \(Optional\))?$"))
    return page.locator(".schema-form-property").filter(has=label).first


def show_refusal(page, out: Path, deployment: str, api_env: Dict[str, str]) -> None:
    """Submit the form with `BAD_RUN_ROOT`: the words under run_root, no run made; then put run_root back."""
    from flows.params import URL_WORDS

    run_root = form_field(page, "run_root").locator("textarea").first
    good = run_root.input_value()
    before = run_ids(deployment, api_env)
    run_root.fill(BAD_RUN_ROOT)
    page.get_by_role("button", name="Submit").click()
    form_field(page, "run_root").get_by_text(f"{URL_WORDS!r} was expected").wait_for(timeout=60_000)
    run_root.scroll_into_view_if_needed()
    page.screenshot(path=str(out / "refusal.png"))
    if run_ids(deployment, api_env) != before:
        raise UiCheckFailed(f"the form made a run with run_root={BAD_RUN_ROOT}")
    run_root.fill(good)


def show_dtype_choices(page, out: Path) -> None:
    """Open the dtype dropdown (its choices: "as stored" first and selected, then the dtype spellings)."""
    control = form_field(page, "dtype").locator("button.p-select-button__control")
    control.evaluate("element => element.scrollIntoView({block: 'center'})")
    choices = page.get_by_role("option")
    control.click()
    if not choices.first.is_visible():
        control.focus()
        page.keyboard.press("ArrowDown")  # the select opens from the keyboard when a click does not
    choices.first.wait_for(timeout=30_000)
    shown = [text.strip() for text in choices.all_inner_texts()]
    if shown[:2] != ["as stored", "bfloat16"] or "selected" not in (choices.first.get_attribute("class") or ""):
        raise UiCheckFailed(f"the dtype dropdown shows {shown}, not 'as stored' (selected) then the dtypes")
    page.screenshot(path=str(out / "dtype.png"))
    page.keyboard.press("Escape")


def whole_page(page, out: Path, name: str, height: int = TALL) -> None:
    """Screenshot ``height`` pixels (the UI scrolls inside its own panel: a full-page shot would cut it)."""
    page.set_viewport_size({"width": WIDTH, "height": height})
    page.wait_for_timeout(500)  # let the panel lay out again
    page.screenshot(path=str(out / name), full_page=True)
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})


def show_run(page, base: str, flow_run_id: str, out: Path, name: str, *texts: str) -> None:
    """Screenshot the run's page (state, tags, log) once it shows every one of ``texts``."""
    page.goto(f"{base}/runs/flow-run/{flow_run_id}", wait_until="networkidle", timeout=120_000)
    for text in texts:
        page.get_by_text(text).first.wait_for(timeout=60_000)
    whole_page(page, out, name)


def browse(base: str, deployment_id: str, out: Path, api_env: Dict[str, str]) -> str:
    """Fill and submit the run form, then run the not-ready and failed steps, wait, screenshot
    (`SCREENSHOTS`). Returns the form's flow run id."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.goto(f"{base}/deployments/deployment/{deployment_id}/run", wait_until="networkidle", timeout=120_000)
        step_input = form_field(page, "step").locator("input").first
        step_input.wait_for(timeout=120_000)
        step_input.fill(str(STEP))
        whole_page(page, out, "form.png", 2600)
        show_dtype_choices(page, out)
        show_refusal(page, out, deployment_id, api_env)
        before = run_ids(deployment_id, api_env)
        page.get_by_role("button", name="Submit").click()
        (flow_run_id,) = wait_for(lambda: run_ids(deployment_id, api_env) - before, 120, "the run's creation")
        ended = wait_for(lambda: final_state(flow_run_id, api_env), RUN_TIMEOUT_S, "the flow run's end", 3.0)
        if ended[0] != "COMPLETED":
            whole_page(page, out, "run.png")
            raise UiCheckFailed(f"flow run {flow_run_id} ended {ended[1]} (see ui-check/run.png and the worker log)")
        show_run(page, base, flow_run_id, out, "run.png", "Completed")
        artifact_id = summary_artifact(flow_run_id, api_env)
        page.goto(f"{base}/artifacts/artifact/{artifact_id}", wait_until="networkidle", timeout=120_000)
        page.get_by_text(f"Step {STEP} of").first.wait_for(timeout=60_000)
        whole_page(page, out, "summary.png")
        # one after the other: queued together, the second's log fills with the worker's aborted submissions
        # (the deployment's concurrency limit is 1), pushing the lines that matter out of the screenshot
        runs = {}
        for step, state in ((NOT_READY_STEP, ("COMPLETED", "NotReady")), (MISSING_STEP, ("FAILED", "Failed"))):
            run = runs[step] = create_run(deployment_id, step, api_env)
            ended = wait_for(lambda run=run: final_state(run, api_env), RUN_TIMEOUT_S, f"flow run {run}'s end", 3.0)
            if ended != state:
                raise UiCheckFailed(f"flow run {run} (step {step}) ended {ended[1]}, not {state[1]} (see the worker log)")
        not_ready, missing = runs[NOT_READY_STEP], runs[MISSING_STEP]
        show_run(page, base, not_ready, out, "not-ready.png", "NotReady", "not-ready", "is not ready")
        show_run(page, base, missing, out, "failed.png", "Failed", "StepNotFound")
        for shown in ("Traceback", "unexpected exception"):  # StepNotFound is the one line that says what failed
            if page.get_by_text(shown).count():
                raise UiCheckFailed(f"flow run {missing}'s log shows {shown!r} for StepNotFound (see ui-check/failed.png)")
        page.goto(f"{base}/runs", wait_until="networkidle", timeout=120_000)
        for text in ("Completed", "NotReady", "Failed"):
            page.get_by_text(text).first.wait_for(timeout=60_000)
        whole_page(page, out, "runs.png")
        browser.close()
    return flow_run_id


def create_run(deployment: str, step: int, api_env: Dict[str, str]) -> str:
    """A run of ``deployment`` for ``step`` (as ``prefect deployment run --param step=N``); its id."""
    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        return str(client.create_flow_run_from_deployment(deployment, parameters={"step": step}).id)


def _client(api_env: Dict[str, str]):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: api_env["PREFECT_API_URL"]}), get_client


def final_state(flow_run_id: str, api_env: Dict[str, str]) -> Optional[Tuple[str, str]]:
    """The run's final state as (type, name), e.g. ("COMPLETED", "NotReady"); None while it has not ended."""
    settings, get_client = _client(api_env)
    with settings, get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    if run.state is None or str(run.state.type.value) not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        return None
    return str(run.state.type.value), str(run.state.name)


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
        print(f"== flow run {flow_run_id} submitted from the form and Completed; step {NOT_READY_STEP} NotReady, "
              f"step {MISSING_STEP} Failed ({time.perf_counter() - started:.1f} s)", flush=True)
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


def readme_images(out: Path, repo: Path = REPO) -> list[Path]:
    """Write the screenshots README shows (`README_IMAGES`) from ``out`` under ``repo``: each page's top, at most
    `README_IMAGE_HEIGHT` pixels once scaled to `README_IMAGE_WIDTH` wide, in 256 colours, scaled down further
    until the file is under `README_IMAGE_BYTES`.

    Returns:
        The images written.
    """
    from PIL import Image

    written = []
    for name, target in README_IMAGES.items():
        with Image.open(out / name) as shot:
            scale = README_IMAGE_WIDTH / shot.width
            top = shot.crop((0, 0, shot.width, min(shot.height, round(README_IMAGE_HEIGHT / scale)))).convert("RGB")
        path = repo / target
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            size = (max(1, round(top.width * scale)), max(1, round(top.height * scale)))
            top.resize(size, Image.LANCZOS).quantize(colors=256).save(path, optimize=True)
            if path.stat().st_size < README_IMAGE_BYTES:
                break
            scale *= 0.8
        written.append(path)
    return written


def run_ui_check() -> int:
    out = Path("ui-check").resolve()
    out.mkdir(exist_ok=True)
    for name in SCREENSHOTS:  # a screenshot of an earlier check never stands in for this one's
        (out / name).unlink(missing_ok=True)
    try:
        check(out)
    except UiCheckFailed as exc:
        print(f"ui-check: {exc}", file=sys.stderr)
        return 1
    missing = [name for name in SCREENSHOTS if not (out / name).is_file()]
    if missing:
        print(f"ui-check: screenshots missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"== screenshots in {out}:")
    for name, shows in SCREENSHOTS.items():
        print(f"   {name:14} {shows}")
    print(f"== README's images: {', '.join(str(path.relative_to(REPO)) for path in readme_images(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(run_ui_check())
