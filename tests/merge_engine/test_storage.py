"""`merge_engine.storage` against every backend: plain paths, ``file://``, real S3 (SeaweedFS), real GCS API
(fake-gcs-server). Tests taking ``storage_root`` run once per backend."""

from __future__ import annotations

import os
import time

import pytest

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import FileEntry, RangeReader

MiB = 1024 * 1024


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(n))


def _rewrite_in_place(url: str, data: bytes) -> None:
    """Rewrite a file the way a trainer saving again would: same name, new content."""
    if storage.is_local(url):
        time.sleep(0.02)  # past the filesystem's timestamp tick (in place: the inode is kept)
        with open(storage.local_path(url), "r+b") as f:
            f.write(data)
    else:
        storage.write_bytes(url, data)


def _other_client(url: str):
    """A second, independent client of the same store (another process, in effect)."""
    fs, _ = storage.filesystem(url)
    return type(fs)(**fs.storage_options, skip_instance_cache=True)


def _path_in(url: str) -> str:
    return storage.split_scheme(url)[1]


class TestListing:
    def test_list_files_gives_relative_paths_sizes_and_versions(self, storage_root):
        """Sorted ``/``-relative paths, exact sizes, a non-empty version for every file (incl. empty ones)."""
        storage.write_bytes(storage.join(storage_root, "b/c/deep.bin"), _payload(300))
        storage.write_bytes(storage.join(storage_root, "a.json"), b"{}")
        storage.write_bytes(storage.join(storage_root, "b/empty"), b"")
        entries = storage.list_files(storage_root)
        assert [(e.path, e.size) for e in entries] == [("a.json", 2), ("b/c/deep.bin", 300), ("b/empty", 0)]
        assert all(e.version for e in entries)
        top = storage.list_files(storage_root, recursive=False)
        assert [e.path for e in top] == ["a.json"]

    def test_missing_root_lists_nothing(self, storage_root):
        assert storage.list_files(storage.join(storage_root, "nope")) == []
        assert storage.list_dirs(storage.join(storage_root, "nope")) == []

    def test_a_sibling_with_a_common_prefix_is_not_listed(self, storage_root):
        """Listing ``step_1`` must not pick up ``step_10/``: prefixes are folder-bounded."""
        storage.write_bytes(storage.join(storage_root, "step_1/x"), b"1")
        storage.write_bytes(storage.join(storage_root, "step_10/x"), b"10")
        assert [e.path for e in storage.list_files(storage.join(storage_root, "step_1"))] == ["x"]

    def test_version_changes_when_a_file_is_rewritten(self, storage_root):
        """Same name, same size, new bytes: a new version, so a new fingerprint (cache key)."""
        url = storage.join(storage_root, "model.pt")
        storage.write_bytes(url, b"A" * 64)
        before = storage.list_files(storage_root)
        _rewrite_in_place(url, b"B" * 64)
        after = storage.list_files(storage_root)
        assert [e.size for e in after] == [64]
        assert after[0].version != before[0].version
        assert storage.fingerprint(after) != storage.fingerprint(before)
        storage.write_bytes(url, b"C" * 64)  # temp + rename (a new inode locally): seen at once
        assert storage.list_files(storage_root)[0].version != after[0].version

    def test_listings_are_never_served_from_a_cache(self, storage_root):
        """Each call asks the server: files another client adds or deletes between two calls show at once
        (s3fs / gcsfs would otherwise answer from their listings cache, which only their own writes clear)."""
        storage.write_bytes(storage.join(storage_root, "step/one"), b"1")
        assert [e.path for e in storage.list_files(storage_root)] == ["step/one"]
        assert storage.list_dirs(storage_root) == ["step"]
        assert storage.list_files(storage.join(storage_root, "step"), recursive=False)[0].path == "one"
        other = _other_client(storage_root)
        for rel, data in (("step/two", b"22"), ("other/three", b"333")):
            path = _path_in(storage.join(storage_root, rel))
            other.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            other.pipe_file(path, data)
        assert [e.path for e in storage.list_files(storage_root)] == ["other/three", "step/one", "step/two"]
        assert [e.path for e in storage.list_files(storage.join(storage_root, "step"), recursive=False)] == [
            "one", "two"]
        assert storage.list_dirs(storage_root) == ["other", "step"]
        other.rm_file(_path_in(storage.join(storage_root, "step/one")))
        assert [e.path for e in storage.list_files(storage_root)] == ["other/three", "step/two"]
        assert storage.exists(storage.join(storage_root, "step/two"))
        assert not storage.exists(storage.join(storage_root, "step/one"))

    def test_list_dirs_names_only_folders(self, storage_root):
        storage.write_bytes(storage.join(storage_root, "global_step_2/actor/x"), b"x")
        storage.write_bytes(storage.join(storage_root, "global_step_10/x"), b"x")
        storage.write_bytes(storage.join(storage_root, "latest_checkpointed_iteration.txt"), b"10")
        assert storage.list_dirs(storage_root) == ["global_step_10", "global_step_2"]


class TestFilesystems:
    def test_a_change_of_server_gives_a_new_client(self, monkeypatch):
        """Clients are shared only while the storage environment stays the same: a test (or a process)
        that points at another server never gets the old server's client, nor its listings."""
        monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", "http://127.0.0.1:1")
        first, _ = storage.filesystem("s3://bucket/x")
        assert storage.filesystem("s3a://bucket/y")[0] is first
        monkeypatch.setenv("STEPMERGE_S3_ENDPOINT", "http://127.0.0.1:2")
        second, _ = storage.filesystem("s3://bucket/x")
        assert second is not first and second.endpoint_url == "http://127.0.0.1:2"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
        assert storage.filesystem("s3://bucket/x")[0] is not second
        assert not first.dircache.use_listings_cache

    def test_a_gcs_emulator_gets_the_plain_anonymous_client(self, monkeypatch):
        import gcsfs.core

        monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
        fs, path = storage.filesystem("gs://bucket/a/b")
        assert type(fs) is gcsfs.core.GCSFileSystem  # not gcsfs's experimental subclass (60 s waits)
        assert fs._location == "http://127.0.0.1:4443" and path == "bucket/a/b"
        assert storage.filesystem("gcs://bucket")[0] is fs


class TestFingerprint:
    A = FileEntry("a.pt", 10, "v1")
    B = FileEntry("b/c.json", 3, "v2")

    def test_stable_whatever_the_order(self):
        assert storage.fingerprint([self.A, self.B], dtype="bf16", engine="1") == storage.fingerprint(
            [self.B, self.A], engine="1", dtype="bf16"
        )

    @pytest.mark.parametrize(
        "changed",
        [
            [FileEntry("a.pt", 11, "v1"), B],  # size
            [FileEntry("a.pt", 10, "v9"), B],  # version
            [FileEntry("A.pt", 10, "v1"), B],  # name
            [A],  # a file missing
            [A, B, FileEntry("d", 0, "v")],  # a file more
        ],
    )
    def test_sensitive_to_every_listing_field(self, changed):
        assert storage.fingerprint(changed, dtype="bf16") != storage.fingerprint([self.A, self.B], dtype="bf16")

    def test_sensitive_to_options(self):
        base = storage.fingerprint([self.A], dtype="bf16")
        assert storage.fingerprint([self.A], dtype="fp32") != base
        assert storage.fingerprint([self.A], dtype="bf16", validate=True) != base
        assert storage.fingerprint([self.A]) != base

    def test_entries_cannot_be_confused_by_separators(self):
        """Names with spaces or digits do not collide with size/version fields."""
        assert storage.fingerprint([FileEntry("a 1", 2, "3")]) != storage.fingerprint([FileEntry("a", 12, "3")])


class TestRangeReader:
    SIZE = 1000

    @pytest.fixture
    def small_chunks(self, monkeypatch):
        monkeypatch.setattr(storage.tuning, "REMOTE_READ_CHUNK", 64)

    @pytest.mark.parametrize(
        "offset,length",
        [(0, 1000), (0, 1), (999, 1), (60, 10), (64, 64), (63, 2), (10, 300), (128, 0)],
    )
    def test_reads_exact_ranges_across_chunk_boundaries(self, storage_root, small_chunks, offset, length):
        """Every range comes back byte-exact, whether it falls inside one chunk or spans several."""
        data = _payload(self.SIZE, seed=3)
        url = storage.join(storage_root, "shard.bin")
        storage.write_bytes(url, data)
        with RangeReader(url) as reader:
            assert reader.size == self.SIZE
            assert reader.read(offset, length) == data[offset:offset + length]
            buffer = bytearray(length)
            reader.read_into(offset, memoryview(buffer))
            assert bytes(buffer) == data[offset:offset + length]

    def test_size_from_the_listing_is_used(self, storage_root, small_chunks):
        data = _payload(200)
        url = storage.join(storage_root, "f")
        storage.write_bytes(url, data)
        (entry,) = storage.list_files(storage_root)
        with RangeReader(url, size=entry.size) as reader:
            assert reader.read(150, 50) == data[150:]

    def test_read_past_the_end_is_an_incomplete_checkpoint(self, storage_root):
        url = storage.join(storage_root, "f")
        storage.write_bytes(url, b"x" * 100)
        with RangeReader(url) as reader:
            with pytest.raises(IncompleteCheckpoint) as info:
                reader.read(90, 11)
            assert info.value.path == url
            with pytest.raises(IncompleteCheckpoint):
                reader.read(-1, 2)

    @pytest.mark.parametrize("offset", [90, 120])
    def test_file_shorter_than_its_listing_is_an_incomplete_checkpoint(self, storage_root, small_chunks, offset):
        """The listing promised 150 bytes, the file has 100: reading the tail fails, it never pads."""
        url = storage.join(storage_root, "f")
        storage.write_bytes(url, b"x" * 100)
        with RangeReader(url, size=150) as reader:
            with pytest.raises(IncompleteCheckpoint):
                reader.read(offset, 20)

    def test_missing_file_is_an_incomplete_checkpoint(self, storage_root):
        with pytest.raises(IncompleteCheckpoint):
            RangeReader(storage.join(storage_root, "never-written"))


class TestStageIn:
    def test_stages_every_file_and_verifies_it(self, storage_root, tmp_path, monkeypatch):
        monkeypatch.setattr(storage.tuning, "REMOTE_READ_CHUNK", 100)
        files = {"actor/model_world_size_2_rank_0.pt": _payload(1000, 1), "actor/model_world_size_2_rank_1.pt":
                 _payload(999, 2), "actor/huggingface/config.json": b"{}", "actor/empty": b""}
        for rel, data in files.items():
            storage.write_bytes(storage.join(storage_root, rel), data)
        entries = storage.list_files(storage_root)
        staged = storage.stage_in(storage_root, entries, str(tmp_path / "cache"), max_workers=2)
        assert sorted(staged) == sorted(files)
        for rel, path in staged.items():
            with open(path, "rb") as f:
                assert f.read() == files[rel]
        if storage.is_local(storage_root):
            assert staged["actor/empty"] == os.path.join(storage.local_path(storage_root), "actor", "empty")
        else:
            assert staged["actor/empty"].startswith(str(tmp_path / "cache"))

    def test_a_size_that_disagrees_with_the_listing_fails_and_stages_nothing(self, storage_root, tmp_path):
        storage.write_bytes(storage.join(storage_root, "a.pt"), b"x" * 10)
        cache = tmp_path / "cache"
        with pytest.raises(IncompleteCheckpoint):
            storage.stage_in(storage_root, [FileEntry("a.pt", 11, "v")], str(cache))
        assert not (cache / "a.pt").exists()
        with pytest.raises(IncompleteCheckpoint):
            storage.stage_in(storage_root, [FileEntry("gone.pt", 1, "v")], str(cache))

    def test_refuses_paths_that_leave_the_root(self, storage_root, tmp_path):
        with pytest.raises(ValueError):
            storage.stage_in(storage_root, [FileEntry("../escape", 1, "v")], str(tmp_path / "cache"))


@pytest.mark.parametrize("remote", ["s3", "gs"])
class TestStageInCache:
    def test_skips_files_already_staged_with_the_same_version(self, remote, request, tmp_path, monkeypatch):
        """A second stage-in of an unchanged listing downloads nothing; a rewritten file (same size,
        new version) is downloaded again, alone."""
        root = request.getfixturevalue(f"{'s3' if remote == 's3' else 'gcs'}_bucket_url") + "/step"
        storage.write_bytes(f"{root}/a.pt", b"a" * 50)
        storage.write_bytes(f"{root}/b.pt", b"b" * 50)
        cache = str(tmp_path / "cache")
        storage.stage_in(root, storage.list_files(root), cache)

        downloads: list[str] = []
        real_download = storage.copies._download

        def counting_download(src, dst, expected_size=None):
            downloads.append(src)
            return real_download(src, dst, expected_size)

        monkeypatch.setattr(storage.copies, "_download", counting_download)
        staged = storage.stage_in(root, storage.list_files(root), cache)
        assert downloads == []
        assert open(staged["a.pt"], "rb").read() == b"a" * 50

        storage.write_bytes(f"{root}/b.pt", b"B" * 50)
        staged = storage.stage_in(root, storage.list_files(root), cache)
        assert downloads == [f"{root}/b.pt"]
        assert open(staged["b.pt"], "rb").read() == b"B" * 50


class TestOpenWrite:
    def test_streams_a_multipart_upload(self, storage_root):
        """12 MiB written in 1 MiB pieces with 5 MiB parts (the S3 minimum) arrives byte-exact; on S3 it
        really went as a 3-part multipart upload."""
        url = storage.join(storage_root, "big.safetensors")
        piece = _payload(MiB, seed=5)
        with storage.open_write(url, block_size=5 * MiB) as out:
            for i in range(12):
                out.write(bytes([i]) + piece[1:])
            assert out.tell() == 12 * MiB
        (entry,) = storage.list_files(storage_root)
        assert entry.size == 12 * MiB
        with RangeReader(url) as reader:
            for i in (0, 5, 11):
                assert reader.read(i * MiB, MiB) == bytes([i]) + piece[1:]
        if storage_root.startswith("s3://"):
            assert entry.version.endswith("-3")

    def test_nothing_appears_when_the_writer_fails(self, storage_root):
        url = storage.join(storage_root, "partial.bin")
        with pytest.raises(RuntimeError):
            with storage.open_write(url, block_size=5 * MiB) as out:
                out.write(b"x" * (6 * MiB))  # past one part: an upload is under way
                raise RuntimeError("writer crashed")
        assert storage.list_files(storage_root) == []
        assert not storage.exists(url)

    def test_an_abandoned_writer_publishes_nothing(self, storage_root):
        url = storage.join(storage_root, "abandoned.bin")
        out = storage.open_write(url)
        out.write(b"half")
        del out
        assert storage.list_files(storage_root) == []

    def test_rewrite_replaces_whole(self, storage_root):
        url = storage.join(storage_root, "f.json")
        with storage.open_write(url) as out:
            out.write(b"first version, long")
        with storage.open_write(url) as out:
            out.write(b"second")
        assert storage.read_bytes(url) == b"second"


BACKENDS = ("local", "file", "s3", "gs")


def _root(kind: str, request, tmp_path, name: str) -> str:
    if kind == "local":
        return str(tmp_path / name)
    if kind == "file":
        return f"file://{tmp_path / name}"
    fixture = "s3_bucket_url" if kind == "s3" else "gcs_bucket_url"
    return request.getfixturevalue(fixture) + f"/{name}"


@pytest.mark.parametrize("src_kind", BACKENDS)
@pytest.mark.parametrize("dst_kind", BACKENDS)
def test_copy_file_between_every_pair_of_backends(src_kind, dst_kind, request, tmp_path, monkeypatch):
    """Byte-exact copies in all 16 directions, streamed in chunks (a small chunk forces several)."""
    monkeypatch.setattr(storage.tuning, "REMOTE_READ_CHUNK", 4096)
    src = storage.join(_root(src_kind, request, tmp_path, "src"), "dir/weights.bin")
    dst = storage.join(_root(dst_kind, request, tmp_path, "dst"), "copied/weights.bin")
    data = _payload(10_000, seed=9)
    storage.write_bytes(src, data)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data
    assert [e.size for e in storage.list_files(dst.rsplit("/", 2)[0])] == [len(data)]
    with pytest.raises(FileNotFoundError):
        storage.copy_file(src + ".missing", dst + ".2")


class TestPaths:
    @pytest.mark.parametrize("base", ["/tmp/run", "file:///tmp/run", "s3://bucket/run", "gs://bucket/run/"])
    @pytest.mark.parametrize("part", ["..", "../x", "a/../../b", "a/..", "/etc/passwd", "a\\..\\b"])
    def test_join_refuses_to_leave_the_base(self, base, part):
        with pytest.raises(ValueError):
            storage.join(base, part)

    def test_join(self):
        assert storage.join("s3://b/run/", "global_step_1", "actor/x.pt") == "s3://b/run/global_step_1/actor/x.pt"
        assert storage.join("gs://b", "a..b") == "gs://b/a..b"
        assert storage.join("/tmp/run", "a/b") == "/tmp/run/a/b"

    def test_split_scheme(self):
        assert storage.split_scheme("s3://b/k") == ("s3", "b/k")
        assert storage.split_scheme("file:///tmp/x") == ("file", "/tmp/x")
        assert storage.split_scheme("relative/x") == ("file", os.path.abspath("relative/x"))


def test_remove_of_a_missing_path_is_fine(storage_root):
    storage.remove(storage.join(storage_root, "never/was"))
    storage.remove(storage.join(storage_root, "never/was"), recursive=True)
    storage.write_bytes(storage.join(storage_root, "d/x"), b"1")
    storage.write_bytes(storage.join(storage_root, "d/sub/y"), b"2")
    storage.write_bytes(storage.join(storage_root, "keep"), b"3")
    storage.remove(storage.join(storage_root, "d"), recursive=True)
    assert [e.path for e in storage.list_files(storage_root)] == ["keep"]
    storage.remove(storage.join(storage_root, "keep"))
    assert storage.list_files(storage_root) == []


def test_small_reads_and_writes(storage_root):
    url = storage.join(storage_root, "meta/fsdp_config.json")
    storage.write_bytes(url, b'{"world_size": 2}')
    assert storage.read_text(url) == '{"world_size": 2}'
    assert storage.size(url) == 17
    assert storage.info(url)["size"] == 17
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(storage_root, "missing.json"))


# --------------------------------------------------------------------------------------------
# is_transient, on exceptions produced by real clients against the real servers through the fault proxy

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
