"""`open_write` (`merge_engine.storage.atomic_writer`): streamed uploads that appear whole or not at all."""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.storage import RangeReader
from tests.merge_engine.storage.patterned import MiB, patterned_bytes as _payload


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

