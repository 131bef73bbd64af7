"""Every flow pushes to the Hub: merge_step against the suite's Prefect server and the local Hub (`tests.hub_server`).

- with ``hub_repo``, a step's release lands on ``step-3`` and ``latest`` follows; run again, no commit;
- without a token the push stage fails in one named line, the release stays published and the summary says so;
- the watcher pushes each new step through merge_step's parameters;
- the manifest's recorded options are the same with and without a push (pushing is not the release's content).
"""

from __future__ import annotations

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine.errors import HubPushRefused
from merge_engine.release.folders import release_url
from merge_engine.release.manifest import is_released, read_manifest
from tests.fixtures_pipeline import copy_steps
from tests.hub_server import WRITE_TOKEN, hub  # noqa: F401 - the fixture


def test_merge_step_pushes_each_step_once_and_a_missing_token_is_one_line(prefect, template_run, hub, tmp_path,
                                                                         monkeypatch):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [3])
    hub.create_repo("tester/run")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    params = MergeStepParams(run_root=run_root, step=3, staging_root=str(tmp_path / "staging"),
                             hub_repo="tester/run", hub_moving_ref="latest")
    with pytest.raises(HubPushRefused, match="no Hugging Face token"):
        merge_step(**params.flow_parameters())
    release = release_url(f"{run_root}/releases", "actor", 3)
    assert is_released(release) and hub.commits == 0  # published; nothing pushed

    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    outcome = merge_step(**params.flow_parameters())
    assert outcome.releases[0].cached  # the release is not built again: only the push ran
    (pushed,) = outcome.pushes
    assert (pushed.revision, pushed.moved_refs, pushed.committed) == ("step-3", ["latest"], True)
    branches = hub.repos["tester/run"].branches
    assert branches["step-3"] == branches["latest"] == pushed.commit and hub.commits == 1
    assert hub.files("tester/run", "step-3")["manifest.json"] == (tmp_path / "run" / "releases" / "actor" /
                                                                  "global_step_3" / "manifest.json").read_bytes()
    again = merge_step(**params.flow_parameters())
    assert not again.pushes[0].committed and hub.commits == 1

    unpushed = tmp_path / "unpushed"  # the same step merged without a push records the same options
    copy_steps(template_run, str(unpushed), [3])
    merge_step(**MergeStepParams(run_root=str(unpushed), step=3, staging_root=str(tmp_path / "staging2"))
               .flow_parameters())
    listed = {"source_listing", "checkpoint_fingerprint"}  # this copy's own listing: another folder, other times

    def settings(url: str) -> dict:
        return {k: v for k, v in read_manifest(url).options.items() if k not in listed}

    assert settings(release_url(f"{unpushed}/releases", "actor", 3)) == settings(release)


def test_the_watcher_pushes_every_new_step(prefect, template_run, hub, tmp_path, monkeypatch):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    hub.create_repo("tester/watched")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    watched = merge_new_steps(**WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"),
                                            hub_repo="tester/watched", hub_moving_ref="latest").flow_parameters())
    assert watched.steps_with("merged") == [1, 2]
    assert [p.revision for o in watched.outcomes for p in o.pushes] == ["step-1", "step-2"]
    branches = hub.repos["tester/watched"].branches
    assert {"step-1", "step-2", "latest"} <= set(branches) and branches["latest"] == branches["step-2"]
