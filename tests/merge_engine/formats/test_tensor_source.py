"""Assemblies of stored pieces: exact values, bounded reads.

Specification: a tensor cut along any dim streams back in row-major chunks equal to torch.cat of
its pieces; replicated copies must agree; a non-contiguous stored piece is read once, not once per
chunk.
"""

import pytest
import torch

from merge_engine.errors import CorruptShard
from merge_engine.storage import RangeReader
from merge_engine.formats.tensor_source import ConcatTensor, ReplicatedTensor
from merge_engine.formats.torch_archive import TorchArchive


class CountingReader(RangeReader):
    def __init__(self, url):
        super().__init__(url)
        self.bytes_read = 0

    def read_into(self, offset, buffer):
        self.bytes_read += memoryview(buffer).nbytes
        super().read_into(offset, buffer)


def _stored(tmp_path, name, **tensors):
    path = str(tmp_path / f"{name}.pt")
    torch.save(tensors, path)
    reader = CountingReader(path)
    return TorchArchive(path, reader).load(), reader


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_concat_streams_exactly_along_any_dim(tmp_path, dim):
    full = torch.randn(5, 6, 7)
    parts = torch.chunk(full, 3, dim=dim)
    tree, _ = _stored(tmp_path, "p", **{f"p{i}": p.contiguous() for i, p in enumerate(parts)})
    assembled = ConcatTensor(tuple(full.shape), full.dtype, dim, tuple(tree[f"p{i}"] for i in range(len(parts))))
    for max_bytes in (4, 52, 10_000):
        assert torch.equal(torch.cat(list(assembled.iter_chunks(max_bytes))), full.reshape(-1))
    assert torch.equal(assembled.read(), full)


def test_a_non_contiguous_piece_is_read_once(tmp_path):
    full = torch.randn(256, 128)
    tree, reader = _stored(tmp_path, "t", w=full.t())  # stored transposed: a non-contiguous view
    assembled = ConcatTensor((128, 256), torch.float32, 0, (tree["w"],))
    before = reader.bytes_read
    assert torch.equal(torch.cat(list(assembled.iter_chunks(4096))), full.t().reshape(-1))
    assert reader.bytes_read - before < full.numel() * 4 + 1024  # 32 chunks, one read (+ a zip header)


def test_replicated_copies_must_agree(tmp_path):
    tree, _ = _stored(tmp_path, "r", a=torch.ones(4), b=torch.ones(4), c=torch.tensor([1.0, 1.0, 2.0, 1.0]))
    assert torch.equal(ReplicatedTensor((tree["a"], tree["b"])).read(), torch.ones(4))
    with pytest.raises(CorruptShard, match="differs between ranks"):
        ReplicatedTensor((tree["a"], tree["c"])).read()


class TestRanges:
    """``iter_range``: any flat range of an assembled tensor, reading only what it needs."""

    @pytest.mark.parametrize("dim", [0, 1, 2])
    def test_concat_range_equals_the_slice(self, tmp_path, dim):
        full = torch.randn(4, 6, 5)
        parts = [p.contiguous() for p in torch.tensor_split(full, 3, dim=dim)]
        path = str(tmp_path / "p.pt")
        torch.save({f"p{i}": p for i, p in enumerate(parts)}, path)
        tree = TorchArchive(path, RangeReader(path)).load()
        assembled = ConcatTensor(tuple(full.shape), full.dtype, dim, tuple(tree[f"p{i}"] for i in range(3)))
        for start, count in ((0, 120), (7, 33), (30, 30), (119, 1)):
            for max_bytes in (4, 36, 10_000):
                got = torch.cat(list(assembled.iter_range(start, count, max_bytes)))
                assert torch.equal(got, full.reshape(-1)[start:start + count])

    def test_one_expert_reads_only_its_bytes(self, tmp_path):
        """A per-expert slice of a tensor sharded on dim 0 is one byte range: nothing else is read."""
        full = torch.randn(4, 8, 16)
        path = str(tmp_path / "e.pt")
        torch.save({"a": full[:2].clone(), "b": full[2:].clone()}, path)
        reader = CountingReader(path)
        tree = TorchArchive(path, reader).load()
        assembled = ConcatTensor((4, 8, 16), torch.float32, 0, (tree["a"], tree["b"]))
        before = reader.bytes_read
        got = torch.cat(list(assembled.iter_range(3 * 128 + 64, 64)))
        assert torch.equal(got, full[3, 4:].reshape(-1))
        assert 64 * 4 <= reader.bytes_read - before < 2 * 64 * 4  # the range (+ a zip entry header), of 2048
