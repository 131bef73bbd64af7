"""Listings, clients, small reads and writes and removal (`merge_engine.storage.files` and the backends' clients)
against every backend: plain paths, ``file://``, real S3 (SeaweedFS), real GCS API (fake-gcs-server).
Tests taking ``storage_root`` run once per backend."""

from __future__ import annotations

import os

import pytest

from merge_engine import storage
from tests.merge_engine.storage.patterned import patterned_bytes as _payload


def _rewrite_in_place(url: str, data: bytes) -> None:
    """Rewrite a file the way a trainer saving again would: same name, new content."""
    if storage.is_local(url):
        path = storage.local_path(url)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(data)
        # in place the inode is kept; a rewrite within the filesystem's timestamp tick would keep the
        # mtime too: the trainer's rewrite comes later, so its mtime is set later (no wait for the tick)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
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
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
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

