"""Pytest plugin for the pipeline tests (tests/tasks, tests/flows, tests/deployments).

Fixtures:
- ``prefect_api`` (session): ONE real Prefect API for the whole session (`prefect_test_harness`,
  10-14 s to start), with task results in a session temp dir. Started on first use only.
- ``prefect`` (function): the API plus a FRESH result storage (and so a fresh cache and lock
  directory) for this test: no cached result leaks from one test into another.
- ``template_run`` (session): a real verl FSDP run written once with torch.distributed (2 ranks,
  FSDP2, a tiny Qwen2): ``global_step_1..3`` full fine-tuning, ``global_step_4`` with LoRA.
  Tests copy the steps they need (`copy_steps`) to a local folder or a bucket and change them there.
  What each step was written from is known outside stepmerge (`TemplateRun.reference_weights`,
  `TemplateRun.trained_model`: the writer's references, PEFT's own model of the LoRA step), for
  `tests.release_checks`.
- ``weight_reads`` (function): every ranged read made through `merge_engine.storage.RangeReader`
  (all checkpoint and model bytes go through it), as (url, bytes).
Helpers: `copy_steps`, `task_runs` (the task runs of a flow run, from the API), `flow_run_id`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Task retry delays are read when `tasks` is imported: short ones for tests (production: 10 s base);
# likewise the pause before a step whose check failed is listed again (production: 3 s).
os.environ.setdefault("STEPMERGE_RETRY_BASE_DELAY_S", "0.2")
os.environ.setdefault("STEPMERGE_SETTLE_S", "0.1")

FULL_STEPS = (1, 2, 3)
LORA_STEP = 4
ROLE = "actor"


@dataclass(frozen=True)
class PrefectApi:
    url: str
    results: Path


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectApi]:
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    with contextlib.ExitStack() as stack:
        # the server writes the events it received every second (its default: 5 s, or 20 events), so a test
        # that reads an event back (tests/deployments/test_notify.py) finds it within a second
        stack.enter_context(temporary_settings(updates={PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL: 1}))
        with patient_health_probes():
            stack.enter_context(prefect_test_harness(server_startup_timeout=90))
        stack.enter_context(temporary_settings(updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: results}))
        yield PrefectApi(url=PREFECT_API_URL.value(), results=results)


@contextlib.contextmanager
def patient_health_probes() -> Iterator[None]:
    """While Prefect's test server starts: its ``/health`` probes wait up to 90 s for an answer.

    The harness probes with httpx's default 5 s timeout and takes only a refused connection for "not up yet",
    so on a loaded machine (the server accepted the connection, then answered late) the probe's ReadTimeout
    failed the whole session's setup and left the server process running. Clients that set a timeout keep it.
    """
    import httpx
    import prefect.server.api.server as server

    class PatientClient(httpx.Client):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("timeout", 90.0)
            super().__init__(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server.httpx, "Client", PatientClient)
        yield


@pytest.fixture
def prefect(prefect_api: PrefectApi, tmp_path: Path) -> Iterator[PrefectApi]:
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

    results = tmp_path / "prefect-results"
    results.mkdir()
    with temporary_settings(updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: results}):
        yield PrefectApi(url=prefect_api.url, results=results)


@dataclass(frozen=True)
class TemplateRun:
    """A run root on local disk that tests copy from (never modify it), and the references of its steps."""

    root: Path
    references: Path

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def files(self, step: int) -> list[Path]:
        return sorted(p for p in self.step_dir(step).rglob("*") if p.is_file())

    def trained_model(self, step: int):
        """The model the step's rank files shard, built again by `synthetic_runs` from its spec and seed
        (for the LoRA step: the PeftModel PEFT makes of it), in eval mode."""
        from synthetic_runs.fsdp import FsdpSpec, build_reference_model

        written = json.loads((self.references / f"global_step_{step}" / "spec.json").read_text())
        return build_reference_model(FsdpSpec.from_dict(written["spec"]), written["seed"]).eval()

    def reference_weights(self, step: int) -> dict:
        """The Hugging Face weights a release of ``step`` must hold: what ``save_pretrained`` wrote for the
        model the writer sharded (a full step), or PEFT's ``merge_and_unload`` of the trained model (LoRA)."""
        from safetensors.torch import load_file

        hf = self.references / f"global_step_{step}" / "hf" / "model.safetensors"
        if hf.exists():
            return load_file(str(hf))
        fused = self.trained_model(step).merge_and_unload()
        state = {k: v.detach().clone().contiguous() for k, v in fused.state_dict().items()}
        if fused.config.tie_word_embeddings:
            del state["lm_head.weight"]
        return state


@pytest.fixture(scope="session")
def template_run(tmp_path_factory: pytest.TempPathFactory) -> TemplateRun:
    from synthetic_runs.fsdp import FsdpSpec, LoraSpec, StepJob, write_fsdp_steps

    base = tmp_path_factory.mktemp("template-run")
    root, references = base / "run", base / "references"
    full = FsdpSpec(world_size=2, strategy="fsdp2")
    lora = FsdpSpec(world_size=2, strategy="fsdp2", lora=LoraSpec(r=4, alpha=8))
    specs = {**dict.fromkeys(FULL_STEPS, full), LORA_STEP: lora}
    write_fsdp_steps([StepJob(str(root / f"global_step_{s}"), spec, s, str(references / f"global_step_{s}"))
                      for s, spec in specs.items()])
    return TemplateRun(root, references)


def copy_steps(template: TemplateRun, run_root: str, steps: Sequence[int], omit: Sequence[str] = ()) -> list[str]:
    """Copy ``steps`` of the template to ``run_root`` (any storage URL); files whose path relative
    to the run root is in ``omit`` are left out. Returns the copied relative paths."""
    from merge_engine import storage

    copied = []
    for step in steps:
        for path in template.files(step):
            rel = path.relative_to(template.root).as_posix()
            if rel in omit:
                continue
            if storage.is_local(run_root):
                target = Path(storage.local_path(run_root)) / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
            else:
                storage.copy_file(str(path), storage.join(run_root, rel))
            copied.append(rel)
    return copied


def rank_file(step: int, rank: int, kind: str = "model", world_size: int = 2) -> str:
    """A rank file's path relative to the run root."""
    return f"global_step_{step}/{ROLE}/{kind}_world_size_{world_size}_rank_{rank}.pt"


@dataclass
class ReadLog:
    reads: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.reads)

    def urls(self) -> set[str]:
        return {url for url, _ in self.reads}


@pytest.fixture
def weight_reads(monkeypatch: pytest.MonkeyPatch) -> ReadLog:
    from merge_engine import storage

    log = ReadLog()
    original = storage.RangeReader.read_into

    def read_into(self, offset, buffer):
        log.reads.append((self.url, memoryview(buffer).nbytes))
        return original(self, offset, buffer)

    monkeypatch.setattr(storage.RangeReader, "read_into", read_into)
    return log


def flow_run_id(state) -> str:
    return str(state.state_details.flow_run_id)


def task_runs(flow_run: str, names: Sequence[str] = (), timeout_s: float = 120.0) -> dict[str, list]:
    """Task runs of a flow run (not its subflows') by task name, each with ``state.name`` and ``run_count``.

    Waits (up to ``timeout_s``) until every task run listed is in a final state and every name in ``names``
    is there: task-run states reach the server as events, recorded after the flow call returns, so one
    read right after a run can show a task still Running or not yet listed (this flaked under load)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run])))
        by_name: dict[str, list] = {}
        for run in runs:
            # "merge-model step 3 actor" (a stage, `flows.run_labels.step_label`) or "discover-steps-3fa" -> the task
            name = run.name.split(" step ", 1)[0] if " step " in run.name else run.name.rsplit("-", 1)[0]
            by_name.setdefault(name, []).append(run)
        settled = runs and all(run.state is not None and run.state.is_final() for run in runs)
        if (settled and all(name in by_name for name in names)) or time.monotonic() > deadline:
            return by_name
        time.sleep(0.2)


def no_task_runs(flow_run: str) -> bool:
    """True when a finished flow run has no task run: every event this process emitted is sent first
    (`EventsWorker.drain_all`), so a task run that did start would be listed (`task_runs` waits for
    runs to appear, which for none would be its whole timeout)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=60, at_exit=False)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run).state.is_final()
        return not client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run])))


def latest_artifacts(key: str | None = None, key_like: str | None = None) -> list:
    """The latest artifacts with ``key`` (or whose key contains ``key_like``), asked for by key: an
    unfiltered listing is one page, and the session's server holds many more artifacts than a page."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    keys = ArtifactCollectionFilterKey(any_=[key]) if key is not None else ArtifactCollectionFilterKey(like_=key_like)
    with get_client(sync_client=True) as client:
        return client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key=keys))


def deploy_watcher(run_root: str, name: str, active: bool = True) -> str:
    """A ``merge-new-steps/<name>`` deployment watching ``run_root`` every 600 s (``active``: its schedule
    on), as `python -m deployments.deploy` makes one; returns its full name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("merge-new-steps")
        client.create_deployment(flow_id, name, parameters={"run_root": run_root}, schedules=[
            DeploymentScheduleCreate(schedule=IntervalSchedule(interval=600), active=active)])
    return f"merge-new-steps/{name}"
