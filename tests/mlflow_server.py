"""A real MLflow tracking server for the tests: ``mlflow server`` on 127.0.0.1, a SQLite backend in its temp folder,
its artifacts in a bucket of the suite's SeaweedFS (``--artifacts-destination s3://...``).

``MlflowServer(s3, bucket).start()`` returns once ``/health`` answers 200 (no fixed sleep); ``url`` is the tracking
URI; ``stop()`` ends it (`tests.servers`' life cycle). The ``mlflow_server`` fixture (session) starts one on first
use and gives its artifact bucket's URL as ``artifacts``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from synthetic_runs.servers import SeaweedS3Server, _http_status, _ServerProcess, free_ports


class MlflowServer(_ServerProcess):
    name = "mlflow"
    startup_timeout = 600.0  # importing mlflow and migrating its database: minutes on a loaded 2-core machine
    start_attempts = 1  # a port taken meanwhile is the only reason to try again, and it shows at once

    def __init__(self, s3: SeaweedS3Server, artifacts: str) -> None:
        super().__init__()
        self.s3 = s3
        self.artifacts = artifacts
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self, root: Path) -> list[str]:
        (self.port,) = free_ports(1)
        return [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'data' / 'mlflow.db'}",
                "--artifacts-destination", self.artifacts]

    def _child_env(self, root: Path) -> dict[str, str]:
        env = {**super()._child_env(root), **self.s3.env(), "MLFLOW_S3_ENDPOINT_URL": self.s3.endpoint_url,
               # no job runner and its seven huey consumers: the registry needs none
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        for key in self.s3.unset_env():
            env.pop(key, None)
        return env

    def _ready(self) -> bool:
        return _http_status(self.url + "/health", timeout=1.0) == 200


@pytest.fixture(scope="session")
def mlflow_server(s3_server: SeaweedS3Server) -> Iterator[MlflowServer]:
    bucket = s3_server.make_bucket("mlflow-artifacts")
    with MlflowServer(s3_server, f"{bucket}/store") as server:
        yield server
