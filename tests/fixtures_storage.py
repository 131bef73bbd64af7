"""Pytest plugin: real storage servers and fresh buckets (list it in ``tests/conftest.py`` ``pytest_plugins``).

Fixtures:
- ``s3_server`` / ``gcs_server`` (session): one SeaweedFS / fake-gcs-server per test session,
  started on first use (a run that needs neither starts neither), stopped at the end.
- ``s3_env`` / ``gcs_env`` (function): the server's environment variables applied with
  ``monkeypatch`` for the test only (nothing leaks into the next test or the session).
- ``s3_bucket_url`` / ``gcs_bucket_url`` (function): a fresh, empty bucket per test, e.g.
  ``s3://bucket-1f2e3d4c5b6a``, with the server's environment applied.
- ``storage_root`` (function, parametrized ``local`` / ``file`` / ``s3`` / ``gs``): an empty
  folder URL on each backend in turn; a test taking it runs four times.
- ``root_url`` (function, parametrized ``local`` / ``memory`` / ``s3`` / ``gs``): a fresh, empty root
  URL on every backend the product serves (a plain path, fsspec's in-process ``memory://``, a
  SeaweedFS bucket, a fake-gcs-server bucket); the storage-sensitive unit tests (discovery, publish,
  release state, validation) take it.
- ``s3_fault_proxy`` / ``gcs_fault_proxy`` (function): a `FaultProxy` in front of the session's
  server, with the environment pointing `merge_engine.storage` through it for this test and
  ``STEPMERGE_STORAGE_TIMEOUT=1`` so that a stall is noticed within a second (not botocore's 60 s).
  Buckets made with ``s3_bucket_url`` / ``gcs_bucket_url`` are reachable through it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from merge_engine import storage
from merge_engine.storage.backends.s3 import S3Backend
from tests.fault_proxy import FaultProxy
from tests.servers import FakeGcsServer, SeaweedS3Server

STORAGE_BACKENDS = ("local", "file", "s3", "gs")
ROOT_BACKENDS = ("local", "memory", "s3", "gs")


def fresh_bucket_name() -> str:
    return f"bucket-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedS3Server]:
    with SeaweedS3Server() as server:
        yield server
        storage.clear_filesystems()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server
        storage.clear_filesystems()


def apply_server_env(monkeypatch: pytest.MonkeyPatch, server: SeaweedS3Server | FakeGcsServer) -> None:
    """Point `merge_engine.storage` (and any client built from the environment) at ``server``, through
    ``monkeypatch`` (a module-scoped fixture passes its own ``pytest.MonkeyPatch.context()``)."""
    for key in server.unset_env():
        monkeypatch.delenv(key, raising=False)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def s3_env(s3_server: SeaweedS3Server, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3Server:
    apply_server_env(monkeypatch, s3_server)
    return s3_server


@pytest.fixture
def gcs_env(gcs_server: FakeGcsServer, monkeypatch: pytest.MonkeyPatch) -> FakeGcsServer:
    apply_server_env(monkeypatch, gcs_server)
    return gcs_server


@pytest.fixture
def s3_bucket_url(s3_env: SeaweedS3Server) -> str:
    return s3_env.make_bucket(fresh_bucket_name())


@pytest.fixture
def gcs_bucket_url(gcs_env: FakeGcsServer) -> str:
    return gcs_env.make_bucket(fresh_bucket_name())


@pytest.fixture(params=STORAGE_BACKENDS)
def storage_root(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty folder URL on one backend: a plain path, ``file://``, ``s3://`` or ``gs://``."""
    kind = request.param
    if kind == "local":
        return str(tmp_path / "root")
    if kind == "file":
        return f"file://{tmp_path / 'root'}"
    if kind == "s3":
        return request.getfixturevalue("s3_bucket_url") + "/root"
    return request.getfixturevalue("gcs_bucket_url") + "/root"


@pytest.fixture(params=ROOT_BACKENDS)
def root_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty root URL on one backend: a plain path, ``memory://``, ``s3://`` or ``gs://``."""
    kind = request.param
    if kind == "local":
        return str(tmp_path)
    if kind == "memory":
        return f"memory:///{uuid.uuid4().hex}"
    return request.getfixturevalue("s3_bucket_url" if kind == "s3" else "gcs_bucket_url")


@pytest.fixture
def s3_fault_proxy(s3_env: SeaweedS3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with FaultProxy(s3_env.port) as proxy:
        monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", proxy.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("STEPMERGE_STORAGE_TIMEOUT", "1")
        yield proxy
        storage.clear_filesystems()  # clients of a proxy that is about to go


@pytest.fixture
def gcs_fault_proxy(gcs_env: FakeGcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_env.port) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        monkeypatch.setenv("STEPMERGE_STORAGE_TIMEOUT", "1")
        yield proxy
        storage.clear_filesystems()  # clients of a proxy that is about to go


@pytest.fixture
def s3_gets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every ranged GET sent to the S3 server from now on, as (URL, start, end): one call is one GET on the wire."""
    log: list[tuple[str, int, int]] = []
    original = S3Backend.read_range

    async def read_range(self, fs, path, start, end, version, url):
        log.append((url, start, end))
        return await original(self, fs, path, start, end, version, url)

    monkeypatch.setattr(S3Backend, "read_range", read_range)
    return log


def upload_step(step_dir: str | Path, run_root: str) -> dict[str, Path]:
    """The step folder ``step_dir`` copied under ``run_root`` (same folder name): URL -> local file."""
    step = Path(step_dir)
    copied = {}
    for path in sorted(p for p in step.rglob("*") if p.is_file()):
        url = storage.join(run_root, step.name, path.relative_to(step).as_posix())
        storage.copy_file(str(path), url)
        copied[url] = path
    return copied
