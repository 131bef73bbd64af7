"""Reads pinned to the version listed (`RangeReader.listed`, issue 17 point 1), on every backend.

Specification:
- a reader opened from a listing's `FileEntry` reads that file exactly while it is unchanged, from
  a local path, ``file://``, S3 (SeaweedFS) and GCS (fake-gcs-server);
- a file replaced after the listing by one of the same size with other bytes is `SourceChanged`
  (naming the file) at the first read, never its new bytes: S3 answers the ``If-Match`` with 412, GCS
  has no more of the listed generation, a local file has another inode / mtime;
- replaced while a reader is open: the next read from S3 or GCS is `SourceChanged`; locally, a file
  rewritten in place is `SourceChanged` at the next read (fstat on the open descriptor), while a
  file replaced by a rename keeps serving the listed version's bytes from the descriptor (the old
  inode): never a mix of two versions;
- a reader without a version (outputs being checksummed, metadata) reads whatever is there, as before.
"""

from __future__ import annotations

import os

import pytest

from merge_engine import storage
from merge_engine.errors import SourceChanged
from merge_engine.storage import RangeReader
from tests.merge_engine.storage.patterned import patterned_bytes

SIZE = 300_000


def _write(url: str, data: bytes) -> None:
    storage.write_bytes(url, data)


def _listed(root: str, name: str) -> storage.FileEntry:
    return next(e for e in storage.list_files(root) if e.path == name)


@pytest.fixture(autouse=True)
def no_read_ahead(monkeypatch):
    """Every read asks the server (a part fetched ahead before a change is of the listed version
    anyway: the replacement below must be met by a request)."""
    monkeypatch.setattr(storage.tuning, "READ_AHEAD_BUDGET", 0)


def test_an_unchanged_file_reads_exactly(storage_root):
    data = patterned_bytes(SIZE, seed=1)
    url = storage.join(storage_root, "rank.pt")
    _write(url, data)
    with RangeReader.listed(url, _listed(storage_root, "rank.pt")) as reader:
        assert reader.read(0, SIZE) == data
        assert reader.read(SIZE - 10, 10) == data[-10:]


def test_a_file_replaced_after_its_listing_is_source_changed(storage_root):
    url = storage.join(storage_root, "rank.pt")
    _write(url, patterned_bytes(SIZE, seed=2))
    entry = _listed(storage_root, "rank.pt")
    _write(url, patterned_bytes(SIZE, seed=3))  # same size, other bytes (a rename onto it, locally)
    with pytest.raises(SourceChanged) as caught:
        with RangeReader.listed(url, entry) as reader:
            reader.read(0, 1000)
    assert caught.value.path == url


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_an_object_replaced_while_open_is_source_changed_at_the_next_read(kind, request):
    root = request.getfixturevalue("s3_bucket_url" if kind == "s3" else "gcs_bucket_url") + "/pinned"
    url = storage.join(root, "rank.pt")
    old = patterned_bytes(SIZE, seed=4)
    _write(url, old)
    with RangeReader.listed(url, _listed(root, "rank.pt")) as reader:
        assert reader.read(0, 1000) == old[:1000]
        _write(url, patterned_bytes(SIZE, seed=5))
        with pytest.raises(SourceChanged) as caught:
            reader.read(1000, 1000)
    assert caught.value.path == url


def test_a_local_file_rewritten_in_place_while_open_is_source_changed(tmp_path):
    path = tmp_path / "rank.pt"
    old = patterned_bytes(SIZE, seed=6)
    path.write_bytes(old)
    entry = _listed(str(tmp_path), "rank.pt")
    with RangeReader.listed(str(path), entry) as reader:
        assert reader.read(0, 1000) == old[:1000]
        with open(path, "r+b") as f:  # same inode, same size, other bytes
            f.seek(SIZE // 2)
            f.write(b"\xff" * 100)
        with pytest.raises(SourceChanged):
            reader.read(SIZE // 2, 100)


def test_a_local_file_renamed_over_while_open_keeps_the_listed_bytes(tmp_path):
    path = tmp_path / "rank.pt"
    old = patterned_bytes(SIZE, seed=7)
    path.write_bytes(old)
    entry = _listed(str(tmp_path), "rank.pt")
    with RangeReader.listed(str(path), entry) as reader:
        replacement = tmp_path / "new.pt"
        replacement.write_bytes(patterned_bytes(SIZE, seed=8))
        os.replace(replacement, path)
        assert reader.read(0, SIZE) == old  # the descriptor's inode: the version listed, whole
    with pytest.raises(SourceChanged):
        RangeReader.listed(str(path), entry)  # a new open meets the new inode


def test_a_reader_without_a_version_reads_what_is_there(storage_root):
    url = storage.join(storage_root, "out.safetensors")
    _write(url, patterned_bytes(SIZE, seed=9))
    _write(url, new := patterned_bytes(SIZE, seed=10))
    with RangeReader(url) as reader:
        assert reader.read(0, SIZE) == new


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_with_read_ahead_every_byte_served_is_of_the_listed_version(kind, request, monkeypatch):
    """Parts fetched ahead before the replacement are the listed version's (each GET was pinned); the
    first part fetched after it is `SourceChanged`: the stream never switches to the new bytes."""
    from merge_engine.storage import read_ahead

    monkeypatch.setattr(storage.tuning, "READ_AHEAD_BUDGET", 64 * 1024)
    monkeypatch.setattr(storage.tuning, "READ_PART_BYTES", 8192)
    monkeypatch.setattr(read_ahead, "MIN_PART_BYTES", 4096)
    root = request.getfixturevalue("s3_bucket_url" if kind == "s3" else "gcs_bucket_url") + "/ahead"
    url = storage.join(root, "rank.pt")
    old = patterned_bytes(SIZE, seed=11)
    _write(url, old)
    served = bytearray()
    with RangeReader.listed(url, _listed(root, "rank.pt")) as reader:
        with pytest.raises(SourceChanged):
            for offset in range(0, SIZE, 10_000):
                served += reader.read(offset, min(10_000, SIZE - offset))
                if offset == 20_000:
                    _write(url, patterned_bytes(SIZE, seed=12))
    assert 30_000 <= len(served) < SIZE and bytes(served) == old[:len(served)]
