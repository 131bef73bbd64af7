"""`is_transient` (`merge_engine.storage.faults`), on exceptions produced by real clients against the real
servers through the fault proxy."""

from __future__ import annotations

import os

import pytest

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import RangeReader
from tests.merge_engine.storage.patterned import MiB


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


INTERNAL = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"


def _s3_faults():
    from tests.fault_proxy import Fault, http_response

    return {
        "reset mid-body": Fault.reset(after_bytes=100_000),
        "stall past the read timeout": Fault.stall(3, after_bytes=100_000),
        "refused": Fault.refuse(connections=5),
        "disconnect before a response": Fault.respond(b"", connections=5),
        "503 SlowDown": Fault.respond(http_response(503, "Slow Down", SLOW_DOWN, "application/xml"), 5),
        "500 InternalError": Fault.respond(http_response(500, "Internal Error", INTERNAL, "application/xml"), 5),
    }


def _gcs_faults():
    from tests.fault_proxy import Fault, http_response

    def json_error(code: int, reason: str) -> bytes:
        body = f'{{"error": {{"code": {code}, "message": "{reason}"}}}}'.encode()
        return http_response(code, reason, body, "application/json")

    return {
        "reset mid-body": Fault.reset(after_bytes=100_000),
        "refused": Fault.refuse(connections=5),
        "disconnect before a response": Fault.respond(b"", connections=5),
        "429 rate limit": Fault.respond(json_error(429, "Too Many Requests")),
        "503 unavailable": Fault.respond(json_error(503, "Service Unavailable")),
        "502 bad gateway": Fault.respond(http_response(502, "Bad Gateway")),
    }


class TestIsTransient:
    @pytest.fixture
    def bare_s3(self, s3_bucket_url, s3_fault_proxy):
        """s3fs through the proxy with every retry off (s3fs's and botocore's): faults surface raw."""
        import s3fs

        storage.write_bytes(f"{s3_bucket_url}/obj", os.urandom(2 * MiB))
        fs = s3fs.S3FileSystem(
            endpoint_url=s3_fault_proxy.url,
            config_kwargs={"retries": {"total_max_attempts": 1}, "read_timeout": 0.5, "connect_timeout": 0.5},
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        fs.retries = 1
        return fs, s3_bucket_url[5:], s3_fault_proxy

    @pytest.mark.parametrize("fault", list(_s3_faults()))
    def test_s3_faults_are_transient(self, bare_s3, fault):
        fs, bucket, proxy = bare_s3
        proxy.set_fault(_s3_faults()[fault])
        with pytest.raises(Exception) as info:
            fs.cat_file(f"{bucket}/obj", start=0, end=MiB)
        assert proxy.faulted >= 1
        assert storage.is_transient(info.value), repr(info.value)

    def test_fsspec_timeout_is_transient(self, bare_s3):
        import fsspec.exceptions

        fs, bucket, proxy = bare_s3
        proxy.set_fault(_s3_faults()["stall past the read timeout"])  # 3 s: the 0.3 s budget runs out first
        with pytest.raises(fsspec.exceptions.FSTimeoutError) as info:
            fs.cat_file(f"{bucket}/obj", start=0, end=MiB, timeout=0.3)
        assert storage.is_transient(info.value)

    def test_s3_permanent_errors_are_not_transient(self, bare_s3, s3_env):
        import s3fs

        fs, bucket, _ = bare_s3
        with pytest.raises(FileNotFoundError) as missing_key:
            fs.cat_file(f"{bucket}/no-such-key")
        with pytest.raises(FileNotFoundError) as missing_bucket:
            fs.cat_file("no-such-bucket-here/x")
        wrong_secret = s3fs.S3FileSystem(
            endpoint_url=s3_env.endpoint_url, key=s3_env.access_key, secret="wrong", skip_instance_cache=True
        )
        with pytest.raises(PermissionError) as denied:
            wrong_secret.cat_file(f"{bucket}/obj")
        for info in (missing_key, missing_bucket, denied):
            assert not storage.is_transient(info.value), repr(info.value)

    @pytest.fixture
    def bare_gcs(self, gcs_bucket_url, gcs_fault_proxy):
        """gcsfs's request function through the proxy, minus its retry decorator: faults surface raw."""
        import fsspec.asyn
        import gcsfs.core

        storage.write_bytes(f"{gcs_bucket_url}/obj", os.urandom(2 * MiB))
        fs = gcsfs.core.GCSFileSystem(
            endpoint_url=gcs_fault_proxy.url, token="anon", skip_instance_cache=True, use_listings_cache=False
        )
        request = gcsfs.core.GCSFileSystem._request.__wrapped__

        def get(key: str = "obj"):
            url = fs.url(f"{gcs_bucket_url[5:]}/{key}")
            return fsspec.asyn.sync(fs.loop, request, fs, "GET", url, headers={"Range": "bytes=0-1048575"})

        return get, gcs_fault_proxy

    @pytest.mark.parametrize("fault", list(_gcs_faults()))
    def test_gcs_faults_are_transient(self, bare_gcs, fault):
        get, proxy = bare_gcs
        proxy.set_fault(_gcs_faults()[fault])
        with pytest.raises(Exception) as info:
            get()
        assert proxy.faulted >= 1
        assert storage.is_transient(info.value), repr(info.value)

    def test_gcs_missing_object_is_not_transient(self, bare_gcs):
        get, _ = bare_gcs
        with pytest.raises(FileNotFoundError) as info:
            get("no-such-object")
        assert not storage.is_transient(info.value)

    def test_stepmerge_errors_are_never_transient(self, storage_root):
        """Every named error is permanent, even one raised from a network fault."""
        from merge_engine import errors

        url = storage.join(storage_root, "short")
        storage.write_bytes(url, b"x")
        with pytest.raises(IncompleteCheckpoint) as real:
            RangeReader(url).read(0, 2)
        assert not storage.is_transient(real.value)
        classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.StepmergeError)]
        assert len(classes) >= 10
        for cls in classes:
            try:
                raise cls("bad input", "s3://b/k") from ConnectionResetError("reset")
            except errors.StepmergeError as exc:
                assert not storage.is_transient(exc), cls

    def test_the_cause_chain_decides(self):
        for transient in (ConnectionResetError(), TimeoutError(), BrokenPipeError(), OSError(104, "reset")):
            try:
                try:
                    raise transient
                except OSError as inner:
                    raise RuntimeError("while reading a shard") from inner
            except RuntimeError as outer:
                assert storage.is_transient(outer)
        for permanent in (ValueError("bad"), KeyError("k"), OSError(5, "I/O error"), RuntimeError("x")):
            assert not storage.is_transient(permanent)
        try:
            raise FileNotFoundError("gone") from ConnectionResetError()
        except FileNotFoundError as exc:
            assert not storage.is_transient(exc)  # the outer, permanent verdict wins

