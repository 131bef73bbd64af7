"""Flat chunk streams (`merge_engine.formats.chunks`).

Specification:
- `flat_slices` cuts a tensor into consecutive flat views of at most ``max_bytes`` (one element
  at least), nothing for an empty tensor;
- `aligned_chunks` re-cuts streams cut at different places (empty chunks included) into tuples of
  equal-length pieces that concatenate back to each stream; streams of different lengths raise the
  caller's error (ValueError by default), even when the shorter one ends first.
"""

from __future__ import annotations

import pytest
import torch

from merge_engine.formats.chunks import aligned_chunks, flat_slices
from merge_engine.errors import CorruptShard

FULL = torch.arange(23, dtype=torch.float32)


def _cut(tensor: torch.Tensor, sizes: list[int]):
    at = 0
    for size in sizes:
        yield tensor[at:at + size]
        at += size
    assert at == tensor.numel()


@pytest.mark.parametrize("max_bytes, sizes", [(1, [1] * 23), (8, [2] * 11 + [1]), (40, [10, 10, 3]), (1000, [23])])
def test_flat_slices(max_bytes, sizes):
    pieces = list(flat_slices(FULL.reshape(23, 1), max_bytes))
    assert [p.numel() for p in pieces] == sizes
    assert torch.equal(torch.cat(pieces), FULL)
    assert all(p.data_ptr() == FULL[sum(sizes[:i])].data_ptr() for i, p in enumerate(pieces))  # views
    assert list(flat_slices(torch.empty(0, 4), 8)) == []


def test_aligned_chunks_recut_three_streams():
    streams = [_cut(FULL, [5, 0, 18]), _cut(FULL * 2, [1, 1, 21]), _cut(FULL * 3, [23])]
    tuples = list(aligned_chunks(*streams))
    assert [t[0].numel() for t in tuples] == [1, 1, 3, 18]
    assert all(len({p.numel() for p in t}) == 1 for t in tuples)
    for i, factor in enumerate((1, 2, 3)):
        assert torch.equal(torch.cat([t[i] for t in tuples]), FULL * factor)


@pytest.mark.parametrize("short_first", [True, False])
def test_streams_of_different_lengths_raise_the_callers_error(short_first):
    short, long = _cut(FULL[:20], [20]), _cut(FULL, [10, 13])
    streams = (short, long) if short_first else (long, short)
    with pytest.raises(ValueError, match="differ in length"):
        list(aligned_chunks(*streams))
    with pytest.raises(CorruptShard, match="differ in length"):
        list(aligned_chunks(_cut(FULL[:20], [20]), _cut(FULL, [23]), error=CorruptShard))
