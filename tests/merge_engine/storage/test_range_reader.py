"""`RangeReader` against every backend: exact ranges, listing sizes, truncation as `IncompleteCheckpoint`."""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import RangeReader
from tests.merge_engine.storage.patterned import patterned_bytes as _payload


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

