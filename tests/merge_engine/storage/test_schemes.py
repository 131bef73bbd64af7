"""The scheme registry (`merge_engine.storage.schemes`): the one list of schemes served, asked by the
engine, flow parameters, Prefect result storage and the webhook; a new store is one file in
`merge_engine/storage/backends/`."""

from __future__ import annotations

import textwrap

import pytest

from merge_engine import storage
from merge_engine.errors import InvalidOption, UnsupportedScheme
from merge_engine.storage import backends, schemes

ABFS_BACKEND = textwrap.dedent('''
    """A stand-in Azure store: fsspec's memory client under the ``abfs`` / ``az`` spellings."""

    from merge_engine.storage.backend import FsspecBackend


    class AbfsBackend(FsspecBackend):
        schemes = ("abfs", "az")

        def make_client(self, **common):
            import fsspec

            return fsspec.filesystem("memory", **common)

        def path_in(self, fs, url, rest):
            return "/abfs-test/" + rest


    BACKEND = AbfsBackend()
''')


@pytest.fixture
def abfs_backend_file(tmp_path, monkeypatch):
    """One new file beside the real backends (the package's search path gains a folder holding it)."""
    (tmp_path / "abfs.py").write_text(ABFS_BACKEND)
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    schemes._registry.cache_clear()
    yield
    schemes._registry.cache_clear()


def test_every_store_is_registered_with_its_spellings():
    assert set(schemes.url_schemes(shared_only=False)) == {"file", "local", "s3", "s3a", "gs", "gcs", "memory"}
    assert set(schemes.url_schemes()) == {"file", "local", "s3", "s3a", "gs", "gcs"}  # memory:// is in-process
    assert set(schemes.remote_schemes()) == {"s3", "s3a", "gs", "gcs"}
    assert set(schemes.remote_schemes(canonical_only=True)) == {"s3", "gs"}
    assert schemes.backend_for("/tmp/x") is schemes.backend_for("file:///tmp/x") is schemes.backend_for("local://x")
    assert schemes.backend_for("s3a://b/k") is schemes.backend_for("s3://b/k")


@pytest.mark.parametrize("url", ["ftp://host/run", "http://evil/x", "hdfs://nn/run"])
def test_an_unserved_scheme_is_a_named_error_listing_the_served_ones(url):
    with pytest.raises(UnsupportedScheme) as info:
        storage.list_files(url)
    assert isinstance(info.value, InvalidOption) and isinstance(info.value, ValueError)
    assert info.value.path == url and "s3" in info.value.message and "gs" in info.value.message


def test_a_new_store_is_one_file(abfs_backend_file):
    """Dropping one backend module in makes the engine, flow parameters, result storage and the webhook
    accept its URLs, and every storage function works through it."""
    from deployments.webhook import WebhookSettings
    from flows.url_checks import checked_url
    from tasks.results import remote_result_storage

    url = "abfs://container/run/step_1"
    storage.write_bytes(storage.join(url, "model.safetensors"), b"x" * 100)
    with storage.open_write(storage.join(url, "big.bin")) as out:
        out.write(b"y" * 1000)
    assert [(e.path, e.size) for e in storage.list_files(url)] == [("big.bin", 1000), ("model.safetensors", 100)]
    with storage.RangeReader(storage.join(url, "big.bin")) as reader:
        assert reader.read(990, 10) == b"y" * 10
    storage.copy_file(storage.join(url, "big.bin"), "az://container/copy.bin")
    assert storage.read_bytes("abfs://container/copy.bin") == b"y" * 1000

    assert checked_url(url) == url and checked_url("az://container/run") == "az://container/run"
    assert "abfs" in WebhookSettings(token="t" * 16).allowed_schemes
    assert remote_result_storage("abfs://container/results").basepath == "abfs://container/results/"


def test_flow_parameters_accept_exactly_the_shared_schemes():
    from flows.url_checks import checked_url

    for good in ("s3://b/run", "s3a://b/run", "gs://b/run", "gcs://b/run", "file:///data/run", "/data/run"):
        assert checked_url(good) == good
    for bad in ("memory://b/run", "ftp://host/run", "abfs://c/run"):
        with pytest.raises(ValueError, match="not allowed"):
            checked_url(bad)


@pytest.mark.parametrize("listed", [("ftp",), ("file",), ("memory",), ("s3", "hdfs")])
def test_the_webhook_refuses_to_start_with_a_scheme_no_object_store_serves(listed, monkeypatch):
    from deployments.webhook import WebhookNotConfigured, WebhookSettings

    monkeypatch.setenv("STEPMERGE_WEBHOOK_SCHEMES", ",".join(listed))
    with pytest.raises(WebhookNotConfigured, match="STEPMERGE_WEBHOOK_SCHEMES: .*not object stores served"):
        WebhookSettings.from_env()
    monkeypatch.setenv("STEPMERGE_WEBHOOK_SCHEMES", "s3")
    assert WebhookSettings.from_env().allowed_schemes == ("s3",)
    monkeypatch.delenv("STEPMERGE_WEBHOOK_SCHEMES")
    assert set(WebhookSettings.from_env().allowed_schemes) == {"s3", "gs"}


def test_result_storage_takes_an_object_store_with_the_engines_client_options(monkeypatch):
    from tasks.results import remote_result_storage

    monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", "http://127.0.0.1:9")
    assert remote_result_storage("s3://b/results").settings["endpoint_url"] == "http://127.0.0.1:9"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:8")
    assert remote_result_storage("gs://b/results").settings == {
        "skip_instance_cache": True, "use_listings_cache": False, "token": "anon", "endpoint_url": "http://127.0.0.1:8"}
    for bad in ("memory://b/results", "/tmp/results", "ftp://h/results"):
        with pytest.raises(ValueError, match="object store"):
            remote_result_storage(bad)
