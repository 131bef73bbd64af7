"""The test ground itself: the real servers start, isolate and stop as promised, and the fault proxy
really injects the faults that the retry tests rely on (and the storage layer recovers from them)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import psutil
import pytest

from merge_engine import storage
from tests.clock import HANG_S, until
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
        """A second, private server: answering once start returns (the wait for it bounded by ``startup_timeout``,
        never measured), then SIGTERM (or SIGKILL) ends it and its temp folder (data + TMPDIR) is gone."""
        server = SeaweedS3Server()
        with server:
            pid, root = server.pid, server._root
            assert server.running and server.make_bucket("started") == "s3://started"  # it answers
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
            assert server.running and server.make_bucket("started") == "gs://started"  # it answers
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


def _raw_get(port: int, bucket: str, key: str, timeout: float = HANG_S,
             received: bytearray | None = None) -> tuple[bytes, OSError | None]:
    """GET an object over a raw socket; return (bytes received, the error that ended it). ``received``, when
    given, grows as the bytes arrive (another thread can watch the transfer's progress)."""
    request = (f"GET /download/storage/v1/b/{bucket}/o/{key}?alt=media HTTP/1.1\r\n"
               f"Host: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n").encode()
    received = bytearray() if received is None else received
    try:
        # a reset can reach the client while connect() returns: that too is a refused connection
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(request)
            while chunk := sock.recv(1 << 16):
                received += chunk
    except OSError as error:
        return bytes(received), error
    return bytes(received), None


class VirtualClock:
    """The proxy's time, moved only by the proxy's own waits: each returns at once with the time moved on
    by its length. ``waits`` lists them as (kind, seconds); ``now`` is their sum."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[tuple[str, float]] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float, kind: str) -> None:
        self.waits.append((kind, seconds))
        self.now += seconds
        await asyncio.sleep(0)


class HeldClock:
    """Proxy waits that last until the test ends them: `until_waiting(n)` returns once n waits are under
    way at the same time; `release` ends them (and lets every later one pass at once). ``waits`` lists
    every wait begun as (kind, seconds)."""

    def __init__(self) -> None:
        self.waits: list[tuple[str, float]] = []
        self._waiting = 0
        self._changed = threading.Condition()
        self._released = threading.Event()

    def time(self) -> float:
        return 0.0

    async def sleep(self, seconds: float, kind: str) -> None:
        with self._changed:
            self.waits.append((kind, seconds))
            self._waiting += 1
            self._changed.notify_all()
        try:
            while not self._released.is_set():  # on the proxy's loop: look again soon, never block it
                await asyncio.sleep(0.005)
        finally:
            with self._changed:
                self._waiting -= 1

    def until_waiting(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self._waiting >= count, HANG_S), \
                f"fewer than {count} proxy waits under way after {HANG_S:.0f} s"

    def release(self) -> None:
        self._released.set()


def _body(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


class TestFaultProxy:
    def test_passes_through(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            response, error = _raw_get(proxy.port, bucket, "big")
        assert error is None and _body(response) == data
        assert (proxy.accepted, proxy.faulted, proxy.fired) == (1, 0, 0)

    def test_reset_after_n_bytes_then_passes(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.reset(after_bytes=100_000))
            response, error = _raw_get(proxy.port, bucket, "big")
            assert isinstance(error, ConnectionResetError)
            assert len(response) <= 100_000
            response, error = _raw_get(proxy.port, bucket, "big")  # only the first connection
            assert error is None and _body(response) == data
            assert (proxy.accepted, proxy.faulted, proxy.fired) == (2, 1, 1)

    def test_fired_counts_faults_that_happened_not_connections_assigned_one(self, gcs_server, big_gcs_object):
        """A reset armed for after more bytes than the response holds never fires: ``faulted`` (connections
        given the fault) says 1, ``fired`` (faults that happened) says 0; a reset that happens counts."""
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.reset(after_bytes=10 * MiB))
            response, error = _raw_get(proxy.port, bucket, "big")
            assert error is None and _body(response) == data
            assert (proxy.faulted, proxy.fired) == (1, 0)
            proxy.set_fault(Fault.reset(after_bytes=100_000))
            _, error = _raw_get(proxy.port, bucket, "big")
            assert isinstance(error, ConnectionResetError)
            assert (proxy.faulted, proxy.fired) == (2, 1)

    def test_stall_pauses_then_resumes(self, gcs_server, big_gcs_object):
        """A stall after 50 000 bytes: exactly those bytes arrive, then nothing while the stall lasts (here:
        until the test ends it), then the rest of the response."""
        bucket, data = big_gcs_object
        clock, received = HeldClock(), bytearray()
        with FaultProxy(gcs_server.port, clock=clock) as proxy, ThreadPoolExecutor(1) as pool:
            proxy.set_fault(Fault.stall(0.6, after_bytes=50_000))
            get = pool.submit(_raw_get, proxy.port, bucket, "big", HANG_S, received)
            clock.until_waiting(1)
            until(lambda: len(received) >= 50_000, "50 000 bytes received before the stall")
            assert proxy.fired == 1 and clock.waits == [("stall", 0.6)]
            assert len(received) == 50_000 and not get.done()  # the stall holds the rest
            clock.release()
            response, error = get.result()
        assert error is None and _body(response) == data

    def test_refuse_and_respond_for_the_first_k_connections(self, gcs_server, big_gcs_object):
        bucket, data = big_gcs_object
        with FaultProxy(gcs_server.port) as proxy:
            proxy.set_fault(Fault.refuse(connections=2))
            for _ in range(2):
                response, error = _raw_get(proxy.port, bucket, "big")
                assert response == b"" and isinstance(error, ConnectionResetError)
            assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
            proxy.set_fault(Fault.respond(http_response(503, "Slow Down", b"busy")))
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"{proxy.url}/storage/v1/b", timeout=5)
            assert info.value.code == 503
            assert urllib.request.urlopen(f"{proxy.url}/storage/v1/b", timeout=5).status == 200


    def test_network_latency_is_paid_once_per_request(self, gcs_server, big_gcs_object):
        """Each request waits the simulated latency once, before it reaches the server (four requests one
        after another: four latencies on the proxy's clock, none for the answers); four requests in flight
        together wait theirs at the same time (none is answered until the test ends the waits), so together
        they cost about one."""
        bucket, data = big_gcs_object
        clock = VirtualClock()
        with FaultProxy(gcs_server.port, network=Network(latency=0.25), clock=clock) as proxy:
            for _ in range(4):
                assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
        assert clock.waits == [("latency", 0.25)] * 4

        held = HeldClock()
        with FaultProxy(gcs_server.port, network=Network(latency=0.25), clock=held) as proxy, \
                ThreadPoolExecutor(4) as pool:
            gets = [pool.submit(_raw_get, proxy.port, bucket, "big") for _ in range(4)]
            held.until_waiting(4)
            assert not any(get.done() for get in gets)
            held.release()
            bodies = [_body(get.result()[0]) for get in gets]
        assert bodies == [data] * 4 and held.waits == [("latency", 0.25)] * 4

    def test_network_bandwidth_caps_each_connection(self, gcs_server, big_gcs_object):
        """At 4 MiB/s per connection, every byte of a 2 MiB response waits its share: the proxy's clock moves
        on by at least half a second; unshaped, the proxy never waits."""
        bucket, data = big_gcs_object
        clock = VirtualClock()
        with FaultProxy(gcs_server.port, clock=clock) as proxy:
            proxy.set_network(Network(bandwidth=4 * MiB))
            response, error = _raw_get(proxy.port, bucket, "big")
            shaped = clock.now
            proxy.set_network(None)
            assert _body(_raw_get(proxy.port, bucket, "big")[0]) == data
        assert error is None and _body(response) == data
        assert {kind for kind, _ in clock.waits} == {"bandwidth"}
        assert shaped >= len(response) / (4 * MiB) and clock.now == shaped


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


def test_prefect_harness_health_probes_wait_while_it_starts():
    """The session's Prefect server start survives a loaded machine: its probes wait 90 s, not httpx's 5 s."""
    import httpx
    import prefect.server.api.server as server

    from tests.fixtures_pipeline import patient_health_probes

    with patient_health_probes():
        with server.httpx.Client() as probe, server.httpx.Client(timeout=3) as chosen:
            assert probe.timeout.read == 90.0 and chosen.timeout.read == 3
    with server.httpx.Client() as after:
        assert after.timeout.read == httpx.Timeout(5.0).read
