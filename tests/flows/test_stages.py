"""The stage chains: one cached task each, its stages nested in it.

Real Prefect tasks run by the real `StageTimer` on the test harness: a chain's run is listed before the
stages nested in it, which run (and are listed) only when the chain is not a cache hit. The chains' stage
names are checked on real runs (tests/flows/test_release_reads.py, test_release_adapter.py).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.stages import StageTimer
from tasks.result_records import RECORD_SERIALIZER


@task(cache_policy=NO_CACHE)
def computes(value: str) -> str:
    return value + "+computed"


@task(cache_key_fn=lambda context, inputs: f"test-chain-{inputs['value']}", persist_result=True,
      result_serializer=RECORD_SERIALIZER)  # the flows' result storage reads no other record
def chain(value: str, timer: StageTimer) -> str:
    """A chain written as the flows write theirs: one cached task, its stages nested and recorded by the timer."""
    return timer.run("second", computes, timer.run("first", computes, value))


@flow
def run_twice(value: str):
    timer = StageTimer()
    first, second = timer.run("chain", chain, value, timer), timer.run("chain", chain, value, timer)
    return first, second, [(run.name, run.state) for run in timer.stages]


def test_a_chain_is_listed_before_its_stages_which_run_only_when_it_does(prefect):
    first, second, runs = run_twice("x")
    assert first == second == "x+computed+computed"  # each stage fed by the one before; the record read back
    assert runs == [("chain", "Completed"), ("first", "Completed"), ("second", "Completed"), ("chain", "Cached")]


def test_a_chains_key_follows_the_content_of_every_folder_it_depends_on(tmp_path):
    """A replacement config (``hf_model_path``), a base (``base_model``), a reference (``reference_url``) and the
    fused model an adapter is checked against (``fused_model_url``): each counts by its listing, not its name."""
    from types import SimpleNamespace

    from flows.stages import ReleaseInputs, release_chain
    from merge_engine.release.folders import ADAPTER, MODEL
    from tasks.records import SETTINGS_RECORDS, CheckpointRecord, StepRecord

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    checkpoint = CheckpointRecord(url="s3://b/run/global_step_3/actor", layout="fsdp", fingerprint="f" * 64, files=())
    step = StepRecord(run_root="s3://b/run", step=3, role="actor", url=checkpoint.url, status="complete",
                      layout="fsdp", fingerprint="s" * 64)
    records = {name: SETTINGS_RECORDS[name]() for name in ("merge", "adapter", "validation", "execution")}

    def key(kind: str, fused_model_url=None, **changes) -> str:
        settings = {name: record.model_copy(update={k: v for k, v in changes.items() if k in type(record).model_fields})
                    for name, record in records.items()}
        inputs = ReleaseInputs(kind=kind, step=step, checkpoint=checkpoint, release="s3://b/rel", settings=settings,
                               staging_root=None, options={}, fused_model_url=fused_model_url)
        # the policy's key function itself: with no result store (guarded or not) the policy gives no key at all
        return release_chain.cache_policy.cache_key_fn(SimpleNamespace(task_run=None),
                                                       {"inputs": inputs, "timer": None, "state": None})

    def keys() -> tuple[str, ...]:
        return (key(MODEL, hf_model_path=str(folder)), key(ADAPTER, base_model=str(folder)),
                key(MODEL, reference_url=str(folder)), key(ADAPTER, fused_model_url=str(folder)))

    before = keys()
    assert before == keys() and len(set(before)) == 4  # stable while the folder is unchanged
    assert key(MODEL) not in before
    (folder / "config.json").write_text('{"rope_theta": 1000000}')  # same name, new content
    assert all(a != b for a, b in zip(before, keys()))


def test_a_task_run_twice_in_one_run_gets_a_second_name(prefect):
    """Issue 20: discover-step ran twice in a run whose check failed (discover, then discover-again), both task
    runs named `discover-step step 1 actor`."""
    from prefect import flow, task

    from flows.stages import StageTimer
    from tests.fixtures_pipeline import flow_run_id

    @task(name="probe-step")
    def probe(value: int) -> int:
        return value

    @flow(name="probe-twice")
    def twice() -> list:
        timer = StageTimer(label="step 1 actor")
        return [timer.run("discover", probe, 1), timer.run("discover-again", probe, 2)]

    state = twice(return_state=True)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id(state)])))
    assert sorted(r.name for r in runs) == ["discover-again step 1 actor", "probe-step step 1 actor"]


def test_the_watchers_summary_names_each_run_and_counts_steps_not_releases():
    """Issue 20: the watcher's artifact listed bare flow-run ids and counted a LoRA step's two releases as two."""
    from flows.merge_new_steps import published_step_count
    from flows.summaries import watch_summary
    from tasks.discover import PublishedRelease

    run_id = "0b9d9c4e-1111-2222-3333-444455556666"
    rows = [{"step": 40, "role": "actor", "action": "submitted", "detail": f"flow run {run_id} (Scheduled)",
             "flow_run_id": run_id, "flow_run_name": "exp1 actor step 40"}]
    text = watch_summary("s3://b/exp1", rows, [], 1.0, published_steps=1, releases=2)
    assert f"[exp1 actor step 40](/runs/flow-run/{run_id}) (Scheduled)" in text
    assert "1 step(s) already published (2 release(s))" in text
    releases = [PublishedRelease(name=name, step=4, url=f"s3://b/exp1/releases/{name}/global_step_4",
                                 fingerprint="f", source="s3://b/exp1/global_step_4/actor")
                for name in ("actor", "actor-adapter")]
    assert published_step_count(releases) == 1


def test_a_step_is_settled_only_when_every_release_it_should_have_was_built_from_its_listing():
    """`settled_steps` names exactly the steps `plan_steps` leaves alone at that listing (discovery's second look
    spares them): not a LoRA step whose adapter is missing or from another listing, not a role the watcher does
    not merge, not a release that records no listing."""
    from flows.merge_new_steps import plan_steps, settled_steps
    from flows.params import WatchParams
    from tasks.discover import PublishedRelease
    from tasks.records import StepRecord

    def release(name: str, step: int, listing: str | None, lora: bool | None = None) -> PublishedRelease:
        return PublishedRelease(name=name, step=step, url=f"/r/{name}/global_step_{step}", fingerprint="f",
                                source=f"/run/global_step_{step}", source_listing=listing, lora=lora)

    published = [release("actor", 1, "L1"),  # a plain step
                 release("actor", 2, "L2", lora=True), release("actor-adapter", 2, "L2"),  # a LoRA step, both
                 release("actor", 3, "L3", lora=True),  # its adapter missing
                 release("actor", 4, "L4", lora=True), release("actor-adapter", 4, "L4-old"),  # built apart
                 release("actor", 5, None),  # a release from before listings were recorded
                 release("critic", 6, "L6")]  # a role not merged
    params = WatchParams(run_root="/run", roles=["actor"])
    settled = settled_steps(published, params)
    assert sorted(settled) == [("actor", 1, "L1"), ("actor", 2, "L2")]
    assert sorted(settled_steps(published, WatchParams(run_root="/run", roles=["actor"], release_adapter=False))) \
        == [("actor", 1, "L1"), ("actor", 2, "L2"), ("actor", 3, "L3"), ("actor", 4, "L4")]  # the models alone

    steps = [StepRecord(run_root="/run", step=n, role="actor", url=f"/run/global_step_{n}/actor", status="complete",
                        layout="fsdp", fingerprint=f"L{n}") for n in range(1, 6)]
    todo, changed, _ = plan_steps(steps, published, params)
    left_alone = {(s.role, s.step, s.fingerprint) for s in steps} - {(s.role, s.step, s.fingerprint)
                                                                     for s in todo + changed}
    assert set(settled) <= left_alone  # a settled step is one the plan leaves alone
