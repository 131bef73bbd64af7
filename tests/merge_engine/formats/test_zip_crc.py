"""The CRC-32 of every zip record read (issue 17 point 5): `merge_engine.formats.zip_crc` and its use by
`TorchArchive` and the merge.

Specification:
- `crc32_combine` equals ``zlib.crc32`` of the concatenation, for any lengths (0 included);
- a record read in pieces of any order, with overlaps, is checked once its pieces cover it; a
  record read in part is completed and checked by `RecordChecks.finish` / `TorchArchive.verify_reads`;
- one flipped bit in a record's data (its CRC-32 left as written, so ``torch.load`` reads it without
  a word) is `CorruptShard` naming the file and the record: when the read reaches it, or, in bytes no
  tensor view reads (a storage larger than its view), when the reads are verified;
- a merge of an FSDP checkpoint with such a flip fails with `CorruptShard` naming the rank file and
  record, and writes nothing; an intact checkpoint's records are all checked on the way.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import zlib

import pytest
import torch

from merge_engine.errors import CorruptShard
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.formats.stored_tensor import StoredTensor
from merge_engine.formats.torch_archive import TorchArchive
from merge_engine.output.jobs import OutputOptions
from merge_engine.formats.zip_crc import RecordChecks, crc32_combine
from tests.merge_engine.formats.zip_records import data_records, flip_bit

VARIANT = "fsdp2_qwen2"


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(17)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_pieces_in_any_order_with_overlaps_check_the_record_once_covered():
    rng = random.Random(5)
    data = rng.randbytes(100_000)
    crc = zlib.crc32(data)
    for _ in range(30):
        checks = RecordChecks("file.pt")
        edges = [0, *sorted(rng.sample(range(1, len(data)), 25)), len(data)]
        pieces = list(zip(edges, edges[1:])) + [(rng.randrange(50_000), rng.randrange(50_000, 100_000))]
        rng.shuffle(pieces)
        for lo, hi in pieces[:-1]:
            checks.add("r", len(data), crc, lo, memoryview(data)[lo:hi])
        for lo, hi in pieces[-1:]:
            checks.add("r", len(data), crc, lo, memoryview(data)[lo:hi])
        assert checks.checked == {"r"} and not checks.pending()


def test_a_flipped_byte_is_corrupt_shard_naming_file_and_record():
    data = bytearray(random.Random(6).randbytes(10_000))
    crc = zlib.crc32(data)
    data[1234] ^= 0x10
    checks = RecordChecks("rank.pt")
    checks.add("archive/data/3", len(data), crc, 0, memoryview(bytes(data))[:5000])
    with pytest.raises(CorruptShard) as caught:
        checks.add("archive/data/3", len(data), crc, 5000, memoryview(bytes(data))[5000:])
    assert caught.value.path == "rank.pt" and "archive/data/3" in caught.value.message


def test_finish_reads_what_was_left_and_checks_it():
    data = random.Random(7).randbytes(40_000)
    checks = RecordChecks("rank.pt")
    checks.add("r", len(data), zlib.crc32(data), 100, memoryview(data)[100:900])
    asked = []

    def read(name, offset, length):
        asked.append((offset, length))
        return memoryview(data)[offset:offset + length]

    checks.finish(read, lambda name: (len(data), zlib.crc32(data)))
    assert asked == [(0, 100), (900, len(data) - 900)] and checks.checked == {"r"}


def _archive_with_a_view_over_part_of_its_storage(path):
    base = torch.arange(1000, dtype=torch.float32)
    torch.save({"head": base[:600], "other": torch.ones(50)}, path)  # "head" shares base's 1000-element storage
    return path


@pytest.mark.parametrize("where", ["read", "unread"])
def test_torch_archive_checks_the_bytes_it_reads_and_verify_reads_the_rest(where, tmp_path):
    path = _archive_with_a_view_over_part_of_its_storage(tmp_path / "state.pt")
    data = path.read_bytes()
    record = data_records(data)[0]  # the 4000-byte storage behind "head"
    bit = 8 * (100 if where == "read" else 3000)
    path.write_bytes(flip_bit(data, record, bit))
    assert torch.load(path, weights_only=True)["head"].shape == (600,)  # torch reads it without a word
    archive = TorchArchive(str(path))
    try:
        head = archive.load()["head"]
        assert isinstance(head, StoredTensor)
        if where == "read":
            with pytest.raises(CorruptShard) as caught:
                head.read_flat(0, 600)
                archive.verify_reads()
        else:
            head.read_flat(0, 600)  # the damage lies past the view: this read cannot see it
            with pytest.raises(CorruptShard) as caught:
                archive.verify_reads()
    finally:
        archive.close()
    assert caught.value.path == str(path) and record in caught.value.message


def test_an_intact_archive_has_every_record_read_checked(tmp_path):
    path = _archive_with_a_view_over_part_of_its_storage(tmp_path / "state.pt")
    archive = TorchArchive(str(path))
    try:
        tree = archive.load()
        for tensor in tree.values():
            tensor.read_flat(0, tensor.numel)
        archive.verify_reads()
        assert archive._crc.checked == set(  # the records read whole and found to match their CRC-32
            data_records(path.read_bytes()))
    finally:
        archive.close()


def test_a_merge_with_flipped_bits_in_a_rank_file_writes_nothing(fsdp_runs, tmp_path):
    """Three bit flips in rank 3's largest record (its embedding rows; rank 3's storage is padded,
    and the last flip lands in the last bytes of the record)."""
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    rank = source / "model_world_size_4_rank_3.pt"
    data = rank.read_bytes()
    record = data_records(data)[0]
    for bit in (5, 8 * 1000 + 3, -1):  # -1: the top bit of the record's last byte
        data = flip_bit(data, record, bit)
    rank.write_bytes(data)
    target = tmp_path / "merged"
    with pytest.raises(CorruptShard) as caught:
        merge_checkpoint(str(source), str(target), OutputOptions(chunk_bytes=1 << 16))
    assert caught.value.path == str(rank) and record in caught.value.message
    assert not target.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".merged")]


def test_a_padding_only_flip_is_caught_by_verify_reads(fsdp_runs, tmp_path):
    """A flip in the very last byte of each rank's largest record: where FSDP2 pads, no tensor view
    reads it, and the check still runs (the job verifies its reads before its shard counts)."""
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    rank = source / "model_world_size_4_rank_3.pt"
    data = rank.read_bytes()
    record = data_records(data)[0]
    archive = TorchArchive(str(rank))
    try:
        archive.load()
        size = archive._infos[record].file_size
        reached = max(v.offset * v.dtype.itemsize + v.span * v.dtype.itemsize
                      for v in archive._views if f"data/{v.storage.key}" in record)
    finally:
        archive.close()
    assert reached < size, "rank 3's largest record is not padded: the test would not reach verify_reads"
    rank.write_bytes(flip_bit(data, record, -1))
    with pytest.raises(CorruptShard) as caught:
        merge_checkpoint(str(source), str(tmp_path / "merged"))
    assert record in caught.value.message
