"""The test ground itself: the real servers start, isolate and stop as promised, and the fault proxy
really injects the faults that the retry tests rely on (and the storage layer recovers from them)."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import psutil
import pytest

from merge_engine import storage
from tests.clock import HANG_S
from tests.fault_proxy import Fault, FaultProxy, Network, http_response
from tests.servers import FakeGcsServer, SeaweedS3Server, applied_env

MiB = 1024 * 1024


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


class TestSeaweedS3Server:
    def test_listens_on_loopback_only_with_telemetry_off(self, s3_server):
        """Every port weed opens (master, volume, filer, S3, gRPC twins, admin) is on 127.0.0.1 and was
        chosen free (none of weed's fixed defaults), and telemetry is off."""
        addresses = _listening_addresses(s3_server.pid)
        assert addresses, "weed listens nowhere?"
        assert {ip for ip, _ in addresses} == {"127.0.0.1"}
        assert {port for _, port in addresses} <= set(s3_server.ports.values())
        assert not {8333, 9333, 8888, 9340, 23646, 7333, 8181, 9101} & {port for _, port in addresses}
        command = psutil.Process(s3_server.pid).cmdline()
        assert "-master.telemetry=false" in command and "-webdav=false" in command
        environment = psutil.Process(s3_server.pid).environ()
        assert environment["GOMEMLIMIT"] == "512MiB"
        assert environment["TMPDIR"].startswith(str(s3_server._root))

    def test_env_points_storage_at_the_server(self, s3_server, monkeypatch):
        for key in s3_server.unset_env():
            monkeypatch.delenv(key, raising=False)
        with applied_env(s3_server.env()):
            url = s3_server.make_bucket("envcheck-" + os.urandom(4).hex())
            storage.write_bytes(f"{url}/x", b"hello")
            assert s3_server.client().get_object(Bucket=url[5:], Key="x")["Body"].read() == b"hello"
            assert s3_server.make_bucket(url[5:]) == url  # an existing bucket is fine
        assert os.environ.get("STEPMERGE_S3_ENDPOINT") != s3_server.endpoint_url

    def test_start_and_stop(self):
        """A second, private server: ready within seconds, then SIGTERM (or SIGKILL) ends it and its temp
        folder (data + TMPDIR) is gone."""
        server = SeaweedS3Server()
        with server:
            pid, root = server.pid, server._root
            assert server.startup_seconds < 20
            assert (root / "data").is_dir() and (root / "tmp").is_dir()
            assert any(p.name.startswith("weed.") for p in (root / "tmp").iterdir())  # its logs went there
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert not root.exists()
        server.stop()  # idempotent


class TestFakeGcsServer:
    def test_listens_on_loopback_and_makes_buckets(self, gcs_server, monkeypatch):
        assert {ip for ip, _ in _listening_addresses(gcs_server.pid)} == {"127.0.0.1"}
        url = gcs_server.make_bucket("gcscheck-" + os.urandom(4).hex())
        assert gcs_server.make_bucket(url[5:]) == url
        for key, value in gcs_server.env().items():
            monkeypatch.setenv(key, value)
        storage.write_bytes(f"{url}/a/b", b"xyz")
        assert [(e.path, e.size) for e in storage.list_files(url)] == [("a/b", 3)]

    def test_start_and_stop(self):
        with FakeGcsServer() as server:
            pid, root = server.pid, server._root
            assert server.startup_seconds < 10
        assert not root.exists()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_applied_env_restores_everything(monkeypatch):
    monkeypatch.setenv("STEPMERGE_T_OLD", "old")
    monkeypatch.delenv("STEPMERGE_T_NEW", raising=False)
    with applied_env({"STEPMERGE_T_OLD": "x", "STEPMERGE_T_NEW": "y"}, unset=("STEPMERGE_T_OLD",)):
        assert os.environ["STEPMERGE_T_NEW"] == "y" and os.environ["STEPMERGE_T_OLD"] == "x"
    assert os.environ["STEPMERGE_T_OLD"] == "old" and "STEPMERGE_T_NEW" not in os.environ


# --------------------------------------------------------------------------------------------
# The fault proxy, at the TCP level, in front of fake-gcs-server (plain HTTP, instant start)


@pytest.fixture
def big_gcs_object(gcs_bucket_url) -> tuple[str, bytes]:
    data = os.urandom(2 * MiB)
    storage.write_bytes(f"{gcs_bucket_url}/big", data)
    return gcs_bucket_url[5:], data


def _raw_get(port: int, bucket: str, key: str, timeout: float = 10.0) -> tuple[bytes, OSError | None, list[float]]:
    """GET an object over a raw socket; return (bytes received, the error that ended it, arrival times)."""
    request = (f"GET /download/storage/v1/b/{bucket}/o/{key}?alt=media HTTP/1.1\r\n"
               f"Host: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n").encode()
    received, times = bytearray(), []
    try:
        # a reset can reach the client while connect() returns: that too is a refused connection
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(request)
            while chunk := sock.recv(1 << 16):
                received += chunk
                times.append(time.monotonic())
    except OSError as error:
        return bytes(received), error, times
    return bytes(received), None, times


def _body(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


class TestFaultProxy:
    def test_passes_through(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            response, error, _ = _raw_get(proxy.port, bucket, "big")
        assert error is None and _body(response) == data
        assert (proxy.accepted, proxy.faulted, proxy.fired) == (1, 0, 0)

    def test_reset_after_n_bytes_then_passes(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.reset(after_bytes=100_000))
            response, error, _ = _raw_get(proxy.port, bucket, "big")
            assert isinstance(error, ConnectionResetError)
            assert len(response) <= 100_000
            response, error, _ = _raw_get(proxy.port, bucket, "big")  # only the first connection
            assert error is None and _body(response) == data
            assert (proxy.accepted, proxy.faulted, proxy.fired) == (2, 1, 1)

    def test_fired_counts_faults_that_happened_not_connections_assigned_one(self, gcs_server, big_gcs_object):
        """A reset armed for after more bytes than the response holds never fires: ``faulted`` (connections
        given the fault) says 1, ``fired`` (faults that happened) says 0; a reset that happens counts."""
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.reset(after_bytes=10 * MiB))
            response, error, _ = _raw_get(proxy.port, bucket, "big")
            assert error is None and _body(response) == data
            assert (proxy.faulted, proxy.fired) == (1, 0)
            proxy.set_fault(Fault.reset(after_bytes=100_000))
            _, error, _ = _raw_get(proxy.port, bucket, "big")
            assert isinstance(error, ConnectionResetError)
            assert (proxy.faulted, proxy.fired) == (2, 1)

    def test_stall_pauses_then_resumes(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.stall(0.6, after_bytes=50_000))
            response, error, times = _raw_get(proxy.port, bucket, "big")
        assert error is None and _body(response) == data
        assert max(b - a for a, b in zip(times, times[1:])) >= 0.55
        assert proxy.fired == 1

    def test_refuse_and_respond_for_the_first_k_connections(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.refuse(connections=2))
            for _ in range(2):
                response, error, _ = _raw_get(proxy.port, bucket, "big")
                assert response == b"" and isinstance(error, ConnectionResetError)
            assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
            proxy.set_fault(Fault.respond(http_response(503, "Slow Down", b"busy")))
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"{proxy.url}/storage/v1/b", timeout=5)
            assert info.value.code == 503
            assert urllib.request.urlopen(f"{proxy.url}/storage/v1/b", timeout=5).status == 200


    def test_network_latency_is_paid_once_per_request(self, gcs_server, big_gcs_object):
        """Each request waits the simulated latency before it reaches the server: four requests one after
        another cost at least four latencies, four in flight together about one."""
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port, network=Network(latency=0.25)) as proxy:
            started = time.monotonic()
            for _ in range(4):
                assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
            one_at_a_time = time.monotonic() - started
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                bodies = list(pool.map(lambda _: _body(_raw_get(proxy.port, bucket, "big")[0]), range(4)))
            in_flight = time.monotonic() - started
        assert bodies == [data] * 4
        assert one_at_a_time >= 4 * 0.25
        assert in_flight < one_at_a_time / 2

    def test_network_bandwidth_caps_each_connection(self, gcs_server, big_gcs_object):
        """2 MiB at 4 MiB/s per connection takes at least half a second; unshaped it is loopback-fast."""
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_network(Network(bandwidth=4 * MiB))
            started = time.monotonic()
            response, error, _ = _raw_get(proxy.port, bucket, "big")
            shaped = time.monotonic() - started
            proxy.set_network(None)
            started = time.monotonic()
            assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
            unshaped = time.monotonic() - started
        assert error is None and _body(response) == data
        assert shaped >= 0.45 and unshaped < shaped


# --------------------------------------------------------------------------------------------
# The storage layer behind the proxy: what recovers, and who does the retrying


@pytest.fixture
def only_library_retries(monkeypatch):
    """Turn merge_engine.storage's own retry layer off: what recovers now, s3fs / gcsfs recovered."""
    monkeypatch.setattr(storage.tuning, "TRANSIENT_ATTEMPTS", 1)


class TestRecoveryOnS3:
    def _object(self, bucket_url: str, size: int = 4 * MiB) -> tuple[str, bytes]:
        data = os.urandom(size)
        storage.write_bytes(f"{bucket_url}/obj", data)
        return f"{bucket_url}/obj", data

    def test_ranged_read_recovers_from_a_reset_by_s3fs_retries(self, s3_bucket_url, s3_fault_proxy,
                                                               only_library_retries):
        url, data = self._object(s3_bucket_url)
        with storage.RangeReader(url) as reader:
            s3_fault_proxy.set_fault(Fault.reset(after_bytes=200_000))
            assert reader.read(MiB, 2 * MiB) == data[MiB:3 * MiB]
        assert s3_fault_proxy.fired == 1

    def test_ranged_read_recovers_from_a_stall(self, s3_bucket_url, s3_fault_proxy, only_library_retries):
        """The stall does not end within the test (an hour) and outlasts STEPMERGE_STORAGE_TIMEOUT (1 s): a
        read that returns at all timed out and was retried (the thread's join only bounds a hang)."""
        url, data = self._object(s3_bucket_url)
        got: list[bytes] = []
        with storage.RangeReader(url) as reader:
            s3_fault_proxy.set_fault(Fault.stall(3600, after_bytes=100_000))
            reading = threading.Thread(target=lambda: got.append(reader.read(0, 3 * MiB)), daemon=True)
            reading.start()
            reading.join(HANG_S)
        assert got == [data[:3 * MiB]], "the read waited on the stall instead of retrying"
        assert s3_fault_proxy.fired == 1

    def test_refused_and_throttled_requests_are_retried(self, s3_bucket_url, s3_fault_proxy, only_library_retries):
        url, data = self._object(s3_bucket_url, size=1000)
        s3_fault_proxy.set_fault(Fault.refuse(connections=1))
        assert storage.RangeReader(url).read(0, 1000) == data
        assert s3_fault_proxy.fired == 1
        slow_down = http_response(503, "Slow Down", b"<Error><Code>SlowDown</Code><Message>Please reduce your "
                                  b"request rate.</Message></Error>", "application/xml")
        s3_fault_proxy.set_fault(Fault.respond(slow_down, connections=1))
        assert storage.RangeReader(url, size=1000).read(10, 10) == data[10:20]
        assert s3_fault_proxy.fired == 2

    def test_whole_object_reads_need_our_retry_layer(self, s3_bucket_url, s3_fault_proxy, monkeypatch):
        """s3fs reads objects above its block size with concurrent ranged GETs that it does NOT retry:
        `read_bytes` fails with the library alone and succeeds with storage's retry layer."""
        url, data = self._object(s3_bucket_url, size=3 * MiB)
        fs, _ = storage.filesystem(url)
        monkeypatch.setattr(fs, "default_block_size", MiB)  # 3 parts instead of waiting for a 50 MiB object
        s3_fault_proxy.set_fault(Fault.reset(after_bytes=100_000))
        monkeypatch.setattr(storage.tuning, "TRANSIENT_ATTEMPTS", 1)
        with pytest.raises(Exception) as info:
            storage.read_bytes(url)
        assert storage.is_transient(info.value)
        monkeypatch.setattr(storage.tuning, "TRANSIENT_ATTEMPTS", 4)
        s3_fault_proxy.set_fault(Fault.reset(after_bytes=100_000))
        assert storage.read_bytes(url) == data

    def test_stage_in_and_multipart_upload_recover(self, s3_bucket_url, s3_fault_proxy, tmp_path):
        url, data = self._object(s3_bucket_url)
        # under one ranged part (reads keep several parts in flight, each on its own connection)
        s3_fault_proxy.set_fault(Fault.reset(after_bytes=100_000))
        staged = storage.stage_in(s3_bucket_url, storage.list_files(s3_bucket_url), str(tmp_path / "cache"))
        assert open(staged["obj"], "rb").read() == data
        s3_fault_proxy.set_fault(Fault.reset(after_bytes=2 * MiB, direction="up"))
        with storage.open_write(f"{s3_bucket_url}/uploaded", block_size=5 * MiB) as out:
            for _ in range(3):
                out.write(data)
        assert s3_fault_proxy.fired == 2  # one reset during the download, one during the upload
        assert storage.read_bytes(f"{s3_bucket_url}/uploaded") == data * 3


def test_ranged_read_on_gcs_recovers_from_a_reset(gcs_bucket_url, gcs_fault_proxy, only_library_retries):
    data = os.urandom(2 * MiB)
    storage.write_bytes(f"{gcs_bucket_url}/obj", data)
    with storage.RangeReader(f"{gcs_bucket_url}/obj") as reader:
        gcs_fault_proxy.set_fault(Fault.reset(after_bytes=100_000))
        assert reader.read(100, MiB) == data[100:100 + MiB]
    assert gcs_fault_proxy.fired == 1
