"""A flow run reads a release's state once per stage at most (issue 18 point 5).

`release_state` (marker + manifest, one listing and the checksums: a local release's files are re-hashed
the first time) is counted in real `merge_step` runs of one step on the session's Prefect API, each read
attributed to the task run (stage) it happened in, or to the flow. Runs: the first (merge, validate,
publish), a re-run (the chain a cache hit), one with other validation settings (a new chain key: the merge
finds the build released, validation reports the release's recorded one), one after a released file was
deleted (the damaged release is rebuilt) and one with the cache lost (the release is found as it is).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

from flows.merge_step import merge_step
from flows.params import MergeStepParams
from merge_engine import storage
from merge_engine.release.folders import release_url
from tests.fixtures_pipeline import copy_steps


@pytest.fixture
def state_reads(monkeypatch) -> Counter:
    """stage -> how many times it called `release_state` (every module holding the engine's function is
    patched, under whatever name it imported it); "flow" counts the calls made outside any task run."""
    from prefect.context import TaskRunContext

    from merge_engine.release import state

    reads: Counter = Counter()
    real = state.release_state

    def counted(url: str):
        context = TaskRunContext.get()
        reads[context.task_run.name.split(" step ", 1)[0] if context is not None else "flow"] += 1
        return real(url)

    for module in list(sys.modules.values()):
        if getattr(module, "release_state", None) is real:
            monkeypatch.setattr(module, "release_state", counted)
    return reads


def test_each_stage_reads_the_release_state_once_at_most(prefect, template_run, tmp_path, state_reads):
    """Before issue 18 a damaged release was read twice by the merge and twice by the publish stage, and a
    validation run on a released output twice (runs of 2, 2, 4, 4 and 3 reads); now the flow reads it once
    and gives it to the chain and every stage in it, and the chain's cache reads it again only when that state
    says its record is no longer the release (a concurrent run may have published since): the damaged
    release. (With a cached record per stage, the damaged release was read by the merge's and the publish's
    cache: 3 reads.)"""
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    params = MergeStepParams(run_root=run_root, step=1, staging_root=str(tmp_path / "staging"), validate_forward=False)

    def reads_of(*stages: str, **changes) -> Counter:
        state_reads.clear()
        outcome = merge_step(**params.model_copy(update=changes).flow_parameters())
        assert [stage.name for stage in outcome.stages] == ["discover", "check", "model-release", *stages]
        return Counter(state_reads)

    chain = ("merge", "validate", "publish")
    first = reads_of(*chain)
    reads = {"first": first, "cached": reads_of(), "other validation": reads_of(*chain, validate_forward=True)}
    os.remove(os.path.join(storage.local_path(release_url(f"{run_root}/releases", "actor", 1)), "tokenizer.json"))
    reads["damaged"] = reads_of(*chain)
    with temporary_settings(updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path / "fresh-cache"}):
        reads["cache lost"] = reads_of(*chain)
    assert all(max(counts.values()) == 1 for counts in reads.values()), reads  # once per stage at most
    assert {run: sum(counts.values()) for run, counts in reads.items()} == {
        "first": 1, "cached": 1, "other validation": 1, "damaged": 2, "cache lost": 1}, reads
    assert first == {"flow": 1} and reads["damaged"] == {"flow": 1, "model-release": 1}
