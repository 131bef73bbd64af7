"""The register-in-mlflow task against the suite's Prefect server: only a transient fault is retried (the MLflow
server out of reach); a refusal (a release on local disk, no tracking server named anywhere) runs once. No MLflow
server is needed: each case fails before one would answer (registering for real: tests/flows/test_registry_flows).
"""

from __future__ import annotations

import pytest

from merge_engine.errors import RegistryRefused
from tasks.registry import RegistryTarget, register_release_version
from tests.merge_engine.release.test_registry import published
from tests.tasks.test_hub_task import _run_count


@pytest.mark.parametrize("case, runs", [("server down", 3), ("local release", 1), ("no server named", 1)])
def test_only_a_server_out_of_reach_is_retried(prefect, s3_bucket_url, tmp_path, monkeypatch, case, runs):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client's own retries: minutes of backoff
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    release = published(tmp_path, str(tmp_path) if case == "local release" else s3_bucket_url, 1)
    target = RegistryTarget(name="task-exp", tracking_uri=None if case == "no server named" else "http://127.0.0.1:9")
    state = register_release_version.with_options(retries=2, retry_delay_seconds=0)(
        release, target, f"{s3_bucket_url}/run", 1, return_state=True)
    assert state.is_failed() and _run_count(state) == runs
    error = state.result(raise_on_failure=False)
    expected = {"server down": "could not be reached", "local release": "on local disk",
                "no server named": "no MLflow tracking server"}[case]
    assert isinstance(error, RegistryRefused) and expected in str(error) and "\n" not in str(error)


def test_an_adapter_release_goes_to_its_own_model():
    assert (RegistryTarget("exp").model_name(False), RegistryTarget("exp").model_name(True)) == ("exp", "exp-adapter")
