"""Every flow registers in MLflow's Model Registry: merge_step and the watcher against the suite's Prefect server
and a real ``mlflow server`` (`tests.mlflow_server`), the run in the suite's SeaweedFS.

- with ``mlflow_model``, a step's release becomes a version whose source is the release URL, tagged with the run
  root, step, fingerprint, manifest sha256 and release URL; run again, the same version (no second one);
- a release MLflow cannot take (on local disk) fails the register stage in one named line, recorded in the outcome
  and the summary; the release stays published;
- the watcher registers each new step through merge_step's parameters (the server from ``MLFLOW_TRACKING_URI``);
- the manifest's recorded options are the same with and without registration.
"""

from __future__ import annotations

import hashlib

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step, summary_key
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.errors import RegistryRefused
from merge_engine.release.folders import release_url
from merge_engine.release.manifest import is_released, read_manifest
from tests.fixtures_pipeline import copy_steps, latest_artifacts
from tests.mlflow_server import mlflow_server  # noqa: F401 - the fixture


def _stored(server, name: str, version: str):
    from mlflow import MlflowClient

    return MlflowClient(server.url, server.url).get_model_version(name, version)


def test_merge_step_registers_each_step_once(prefect, template_run, s3_bucket_url, mlflow_server, tmp_path):
    run_root = f"{s3_bucket_url}/run"
    copy_steps(template_run, run_root, [3])
    params = MergeStepParams(run_root=run_root, step=3, staging_root=str(tmp_path / "staging"),
                             mlflow_model="flow-exp", mlflow_tracking_uri=mlflow_server.url)
    outcome = merge_step(**params.flow_parameters())
    release = release_url(f"{run_root}/releases", "actor", 3)
    (registered,) = outcome.registrations
    assert (registered.name, registered.source, registered.created, registered.error) == ("flow-exp", release,
                                                                                          True, "")
    stored = _stored(mlflow_server, "flow-exp", registered.version)
    sha = hashlib.sha256(storage.read_bytes(f"{release}/manifest.json")).hexdigest()
    assert stored.source == release
    assert {k: v for k, v in stored.tags.items() if k.startswith("stepmerge.")} == {
        "stepmerge.run_root": run_root, "stepmerge.step": "3",
        "stepmerge.fingerprint": read_manifest(release).fingerprint, "stepmerge.manifest_sha256": sha,
        "stepmerge.release_url": release}
    assert "register" in [s.name for s in outcome.stages]
    (markdown,) = latest_artifacts(summary_key(params))
    assert "MLflow Model Registry" in markdown.data and "flow-exp" in markdown.data

    again = merge_step(**params.flow_parameters())
    assert again.releases[0].cached  # the release is not built again: only the registration ran
    assert (again.registrations[0].version, again.registrations[0].created) == (registered.version, False)

    unregistered = f"{s3_bucket_url}/unregistered"  # the same step merged without registration records the same
    copy_steps(template_run, unregistered, [3])
    merge_step(**MergeStepParams(run_root=unregistered, step=3, staging_root=str(tmp_path / "staging2"))
               .flow_parameters())
    listed = {"source_listing", "checkpoint_fingerprint"}  # this copy's own listing: another folder, other times

    def settings(url: str) -> dict:
        return {k: v for k, v in read_manifest(url).options.items() if k not in listed}

    assert settings(release_url(f"{unregistered}/releases", "actor", 3)) == settings(release)


def test_a_refused_registration_is_one_line_and_the_release_stays(prefect, template_run, mlflow_server, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [2])
    params = MergeStepParams(run_root=run_root, step=2, staging_root=str(tmp_path / "staging"),
                             mlflow_model="flow-local", mlflow_tracking_uri=mlflow_server.url)
    with pytest.raises(RegistryRefused, match="on local disk") as err:
        merge_step(**params.flow_parameters())
    assert "\n" not in str(err.value)
    assert is_released(release_url(f"{run_root}/releases", "actor", 2))  # published; not registered
    (markdown,) = latest_artifacts(summary_key(params))
    assert "registration failed" in markdown.data and "on local disk" in markdown.data


def test_the_watcher_registers_every_new_step(prefect, template_run, s3_bucket_url, mlflow_server, tmp_path,
                                              monkeypatch):
    run_root = f"{s3_bucket_url}/watched"
    copy_steps(template_run, run_root, [1, 2])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)  # no mlflow_tracking_uri: the worker's server
    watched = merge_new_steps(**WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"),
                                            mlflow_model="flow-watched").flow_parameters())
    assert watched.steps_with("merged") == [1, 2]
    registered = [g for o in watched.outcomes for g in o.registrations]
    assert [(g.name, g.source, g.created) for g in registered] == [
        ("flow-watched", release_url(f"{run_root}/releases", "actor", step), True) for step in (1, 2)]
    assert [_stored(mlflow_server, "flow-watched", g.version).tags["stepmerge.step"] for g in registered] == ["1", "2"]
