"""torch.distributed.checkpoint folders read and written without a process group.

Specification:
- `DcpWriter` output is a DCP folder torch's own reader loads (N-d chunks at any offsets, bytes entries);
- `DcpTensor` reads any box of a global tensor (fixed leading indices, row ranges, boxes crossing
  chunk borders, chunks cut on inner dims) exactly as slicing the full tensor, and streams it in
  bounded row-major pieces;
- ``.metadata`` is parsed by the allow-list unpickler: a pickle asking for anything else raises
  `UnsafePickle` before it runs; missing ``.metadata`` is `IncompleteCheckpoint`; chunks that do not
  tile the tensor exactly (a gap, or overlapping chunks whose element count hides a gap) are
  `CorruptShard` naming ``.metadata``, and `DcpTensor` re-checks the tiling of every box before
  reading it.
"""

import os
import pickle

import pytest
import torch

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafePickle
from merge_engine.formats.torch_dcp import DcpFiles, DcpTensor
from merge_engine.formats.dcp_index import read_index
from tests.merge_engine.formats.dcp_writer import DcpWriter, read_object

FULL = torch.arange(4 * 6 * 10, dtype=torch.float32).reshape(4, 6, 10)
# chunks cut on dims 0 and 1 and 2, unevenly, in a scrambled order
CUTS = [((0, 0, 0), (2, 6, 4)), ((2, 0, 0), (2, 3, 4)), ((2, 3, 0), (2, 3, 4)), ((0, 0, 4), (4, 6, 6))]


def _write(folder, chunks=CUTS):
    writer = DcpWriter(str(folder))
    for offsets, sizes in reversed(chunks):
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        writer.add_chunk("stack.weight", FULL.shape, offsets, FULL[box])
    writer.add_object("extra/shard_0_1", b"opaque bytes")
    writer.close()
    return str(folder)


def _tensor(url, lead=()):
    index = read_index(url)
    files = DcpFiles(url, {e.path: e.size for e in storage.list_files(url)})
    return DcpTensor("stack.weight", index.tensors["stack.weight"], files, lead), index, files


def test_torch_reads_what_the_writer_wrote(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    url = _write(tmp_path / "ckpt")
    state = {"stack.weight": torch.empty_like(FULL)}
    dcp.load(state, storage_reader=FileSystemReader(url), no_dist=True)
    assert torch.equal(state["stack.weight"], FULL)


def test_boxes_read_exactly(tmp_path):
    url = _write(tmp_path / "ckpt")
    whole, index, files = _tensor(url)
    assert whole.shape == (4, 6, 10) and whole.dtype == torch.float32
    assert torch.equal(whole.read(), FULL)
    for layer in range(4):
        tensor, _, _ = _tensor(url, (layer,))
        assert torch.equal(tensor.read(), FULL[layer])
        assert torch.equal(tensor.read_box((1, 2), (4, 7)), FULL[layer, 1:5, 2:9])
        for row in range(6):
            assert torch.equal(_tensor(url, (layer, row))[0].read(), FULL[layer, row])
    assert torch.equal(whole.read_box((1, 2, 3), (3, 3, 5)), FULL[1:4, 2:5, 3:8])
    assert read_object(url, index.objects["extra/shard_0_1"]) == b"opaque bytes"


@pytest.mark.parametrize("max_bytes", [1, 40, 240, 10_000])
def test_streaming_is_row_major_and_bounded(tmp_path, max_bytes):
    url = _write(tmp_path / "ckpt")
    tensor, _, _ = _tensor(url, (2,))
    chunks = list(tensor.iter_chunks(max_bytes))
    assert torch.equal(torch.cat(chunks), FULL[2].reshape(-1))
    assert all(c.numel() * 4 <= max(max_bytes, 40) for c in chunks)  # one row (10 floats) at least


def test_metadata_pickle_runs_nothing(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafePickle, match="os|posix|system"):
        read_index(str(folder))
    assert not (tmp_path / "pwned").exists()


def test_missing_metadata_and_gaps(tmp_path):
    with pytest.raises(IncompleteCheckpoint, match=r"\.metadata missing"):
        read_index(str(tmp_path))
    url = _write(tmp_path / "gap", CUTS[:-1])  # the last chunk never written: the tensor is not covered
    with pytest.raises(CorruptShard, match="do not cover"):
        read_index(url)


def test_overlapping_chunks_are_refused_even_when_the_count_adds_up(tmp_path):
    """A chunk listed twice (rows 2..3 never saved) has the right element count but leaves a gap:
    the index is refused, naming ``.metadata``, instead of reading uninitialised memory."""
    writer = DcpWriter(str(tmp_path / "twice"))
    writer.add_chunk("w", (4, 2), (0, 0), torch.ones(2, 2))
    writer.add_chunk("w", (4, 2), (0, 0), torch.ones(2, 2))
    writer.close()
    with pytest.raises(CorruptShard, match="overlap") as info:
        read_index(str(tmp_path / "twice"))
    assert info.value.path.endswith(".metadata")
    # overlapping on an inner dim only: [0:2, 0:3] and [0:2, 2:4] share column 2; rows 2..3 left out
    writer = DcpWriter(str(tmp_path / "inner"))
    writer.add_chunk("w", (3, 4), (0, 0), torch.ones(2, 3))
    writer.add_chunk("w", (3, 4), (0, 2), torch.ones(2, 2))
    writer.add_chunk("w", (3, 4), (2, 0), torch.ones(1, 2))
    writer.close()
    with pytest.raises(CorruptShard, match="overlap"):
        read_index(str(tmp_path / "inner"))


def test_reading_a_box_the_chunks_do_not_tile_is_refused(tmp_path):
    """`DcpTensor` checks the tiling itself, whatever index it is given, before reading: a chunk
    listed twice (element count right, rows 2..3 missing) or a plain gap raises `CorruptShard`,
    never uninitialised memory; boxes the chunks do cover still read."""
    from merge_engine.formats.dcp_index import TensorInfo

    writer = DcpWriter(str(tmp_path / "half"))
    writer.add_chunk("w", (2, 2), (0, 0), torch.ones(2, 2))
    writer.close()
    url = str(tmp_path / "half")
    (chunk,) = read_index(url).tensors["w"].chunks
    files = DcpFiles(url, {e.path: e.size for e in storage.list_files(url)})
    with pytest.raises(CorruptShard, match="overlap"):
        DcpTensor("w", TensorInfo((4, 2), torch.float32, (chunk, chunk)), files).read()
    holed = DcpTensor("w", TensorInfo((4, 2), torch.float32, (chunk,)), files)
    with pytest.raises(CorruptShard, match=r"do not cover the element at \(2, 0\)"):
        holed.read()
    assert torch.equal(holed.read_box((0, 0), (2, 2)), torch.ones(2, 2))


def test_tiling_check_on_a_grid_too_large_to_mark(monkeypatch):
    """Past `MAX_GRID_CELLS` the check compares chunks pairwise: same verdicts."""
    from merge_engine.formats import dcp_index

    monkeypatch.setattr(dcp_index, "MAX_GRID_CELLS", 1)
    assert dcp_index.tiling_problem((4, 6, 10), CUTS) is None
    assert "overlap" in dcp_index.tiling_problem((4, 2), [((0, 0), (2, 2)), ((0, 0), (2, 2))])
    assert "overlap" in dcp_index.tiling_problem((3, 4), [((0, 0), (2, 3)), ((0, 2), (2, 2)), ((2, 0), (1, 2))])
    assert "do not cover" in dcp_index.tiling_problem((4, 6, 10), CUTS[:-1])


def test_a_metadata_entry_missing_a_field_is_corrupt_not_a_crash(tmp_path):
    """A storage entry without relative_path (a foreign or truncated writer): CorruptShard naming .metadata."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    class _StorageInfo:  # pickled under torch's own name, but without relative_path
        def __init__(self):
            self.offset, self.length = 0, 8

    _StorageInfo.__module__ = dcp_filesystem.__name__
    _StorageInfo.__qualname__ = "_StorageInfo"
    real = dcp_filesystem._StorageInfo
    dcp_filesystem._StorageInfo = _StorageInfo
    try:
        metadata = Metadata(
            state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]),
                                                            [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])},
            storage_data={MetadataIndex("w", torch.Size([0])): _StorageInfo()})
        data = pickle.dumps(metadata)
    finally:
        dcp_filesystem._StorageInfo = real
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(CorruptShard, match="malformed") as info:
        read_index(str(tmp_path))
    assert info.value.path.endswith(".metadata")


# --- issue 9, case 14: lying metadata -----------------------------------------------------------------


def _rewrite_metadata(folder, change):
    """Load our own ``.metadata`` with torch's classes (a trusted file we wrote), change it, save it."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))
    return path


def _two_chunks(folder):
    writer = DcpWriter(str(folder))
    writer.add_chunk("w", (4, 2), (0, 0), torch.ones(2, 2))
    writer.add_chunk("w", (4, 2), (2, 0), torch.zeros(2, 2))
    writer.close()
    return folder


def _storage_entries(metadata):
    return sorted(metadata.storage_data.items(), key=lambda kv: tuple(kv[0].offset or ()))


def test_two_chunks_pointing_at_one_item_are_refused(tmp_path):
    """Metadata pointing both chunks at one saved item would make one stored chunk stand for two."""
    def same_item(metadata):
        (first, info), (second, _) = _storage_entries(metadata)
        metadata.storage_data[second] = info

    path = _rewrite_metadata(_two_chunks(tmp_path / "shared"), same_item)
    with pytest.raises(CorruptShard, match="share bytes") as info:
        read_index(str(tmp_path / "shared"))
    assert info.value.path == str(path)


@pytest.mark.parametrize("lie", ["negative-offset", "negative-length", "negative-size", "short-item", "huge-shape",
                                 "float-offset"])
def test_lying_offsets_lengths_and_sizes_are_refused(tmp_path, lie):
    """Negative or non-integer numbers, an item too short for its chunk, a shape far beyond the bytes:
    `CorruptShard` naming ``.metadata``, before any weight is read."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def change(metadata):
        (first, info), (second, info2) = _storage_entries(metadata)
        entry = metadata.state_dict_metadata["w"]
        if lie == "negative-offset":
            info.offset = -5
        elif lie == "negative-length":
            info.length = -1
        elif lie == "float-offset":
            info.offset = 1.5
        elif lie == "negative-size":
            entry.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, -2]))
        elif lie == "short-item":
            info.length = 10
            info2.offset = 10
        elif lie == "huge-shape":  # 10^12 x 2 floats from two 2 x 2 chunks: the item lengths say no
            entry.size = torch.Size([10**12, 2])
            entry.chunks[1] = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([10**12 - 2, 2]))

    folder = _two_chunks(tmp_path / lie)
    path = _rewrite_metadata(folder, change)
    with pytest.raises(CorruptShard) as info:
        read_index(str(folder))
    assert info.value.path == str(path)


def test_oversized_and_deeply_nested_metadata_are_named_errors(tmp_path, monkeypatch):
    from merge_engine.formats import dcp_index

    folder = _two_chunks(tmp_path / "big")
    monkeypatch.setattr(dcp_index, "MAX_METADATA_BYTES", 100)
    with pytest.raises(CorruptShard, match="larger than any checkpoint index"):
        read_index(str(folder))
    monkeypatch.undo()
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / ".metadata").write_bytes(b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b".")
    with pytest.raises(CorruptShard) as info:
        read_index(str(nested))
    assert info.value.path == str(nested / ".metadata")


def test_a_chunk_item_cannot_read_outside_its_window(tmp_path):
    """An item whose archive claims bytes past the item's length is refused, not read from the next item."""
    from merge_engine.formats.torch_dcp import _Window

    path = tmp_path / "data"
    path.write_bytes(bytes(100))
    window = _Window(storage.RangeReader(str(path)), 10, 20)
    assert window.read(0, 20) == bytes(20)
    with pytest.raises(CorruptShard, match="leaves the 20-byte item"):
        window.read(5, 20)
