"""Registering a published release in MLflow's Model Registry, against a real ``mlflow server`` (SQLite backend,
artifacts in the suite's SeaweedFS: `tests.mlflow_server`):

- the version's source is the release's URL and its tags name the run root, step, fingerprint, manifest sha256 and
  release URL; no byte of the release lands in MLflow's artifact store (the weights stay where they are);
- registering the same release again gives the same version; a release published again (another manifest) gets a
  new one;
- refusals are one named line: a local release (MLflow takes no local source), the server out of reach (the only
  one marked transient), a folder that is no release.
"""

from __future__ import annotations

import hashlib

import pytest

from merge_engine import storage
from merge_engine.cli import main
from merge_engine.errors import RegistryRefused, ReleaseIncomplete
from merge_engine.release.publish import publish
from merge_engine.release.registry import register_release
from merge_engine.validate import Check, ValidationReport
from tests.mlflow_server import mlflow_server  # noqa: F401 - the fixture

WEIGHTS = bytes(range(256)) * 256
REPORT = ValidationReport("x", (Check("finite", True, "ok"),))


def published(tmp_path, root: str, step: int, weights: bytes = WEIGHTS) -> str:
    staging = tmp_path / f"staging-{step}-{hashlib.sha256(weights).hexdigest()[:6]}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(weights)
    (staging / "config.json").write_bytes(b'{"architectures": ["Qwen2ForCausalLM"]}')
    release = f"{root}/run/releases/actor/global_step_{step}"
    publish(str(staging), release, source=f"{root}/run/global_step_{step}/actor",
            fingerprint=f"fp-{step}-{hashlib.sha256(weights).hexdigest()[:12]}", options={"kind": "model"},
            validation=REPORT, engine_version="0", overwrite=True)
    return release


def _artifact_objects(server) -> list[str]:
    listed = server.s3.client().list_objects_v2(Bucket="mlflow-artifacts")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_a_release_becomes_a_version_by_reference_once(mlflow_server, s3_bucket_url, tmp_path):
    release = published(tmp_path, s3_bucket_url, 3)
    version = register_release(release, mlflow_server.url, "exp1-actor")
    assert version.created and version.source == release
    manifest_sha = hashlib.sha256(storage.read_bytes(f"{release}/manifest.json")).hexdigest()

    from mlflow import MlflowClient

    stored = MlflowClient(mlflow_server.url, mlflow_server.url).get_model_version("exp1-actor", version.version)
    assert stored.source == release
    assert {k: v for k, v in stored.tags.items() if k.startswith("stepmerge.")} == {
        "stepmerge.run_root": f"{s3_bucket_url}/run", "stepmerge.step": "3",
        "stepmerge.fingerprint": f"fp-3-{hashlib.sha256(WEIGHTS).hexdigest()[:12]}",
        "stepmerge.manifest_sha256": manifest_sha, "stepmerge.release_url": release}
    assert _artifact_objects(mlflow_server) == []  # nothing copied: the weights stay in the release

    again = register_release(release, mlflow_server.url, "exp1-actor")
    assert not again.created and again.version == version.version
    republished = register_release(published(tmp_path, s3_bucket_url, 3, WEIGHTS[::-1]), mlflow_server.url,
                                   "exp1-actor")
    assert republished.created and int(republished.version) == int(version.version) + 1


def test_stepmerge_register(mlflow_server, s3_bucket_url, tmp_path, capsys):
    release = published(tmp_path, s3_bucket_url, 5)
    args = ["register", release, "--tracking-uri", mlflow_server.url, "--name", "exp-cli"]
    assert main(args) == 0 and "exp-cli version 1: registered" in capsys.readouterr().out
    assert main(args) == 0 and "already registered" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["local release", "server down", "no release"])
def test_each_refusal_is_one_named_line(mlflow_server, s3_bucket_url, tmp_path, monkeypatch, case):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client's own retries: minutes of backoff
    if case == "no release":
        release, error, words = f"{s3_bucket_url}/nothing/global_step_1", ReleaseIncomplete, "not a published release"
    elif case == "local release":
        release, error, words = published(tmp_path, str(tmp_path), 2), RegistryRefused, "on local disk"
    else:
        release, error, words = published(tmp_path, s3_bucket_url, 2), RegistryRefused, "could not be reached"
    uri = "http://127.0.0.1:9" if case == "server down" else mlflow_server.url
    with pytest.raises(error, match=words) as err:
        register_release(release, uri, "exp-refused")
    assert "\n" not in str(err.value)
    assert getattr(err.value, "transient", False) == (case == "server down")  # only an unreachable server is retried
