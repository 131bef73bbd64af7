"""`merge_engine.layouts.dtensor_blocks` gives torch's answer without importing torch's DTensor code.

- `local_block` equals ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` on
  every coordinate of every small case: 1-D, 2-D and 3-D meshes; ``Shard``, ``_StridedShard``
  (split factors 1-3) and ``Replicate`` on either dim, the same dim sharded twice; sizes that divide
  evenly, unevenly, and leave ranks empty (size 0, smaller than the mesh).
- `placement_of` reads the unpickler's records (what a rank file holds) and refuses others (Partial,
  a missing dim or split factor, a bool dim).
- A run on a long dim stays a few runs (no per-element index lists).
"""

from __future__ import annotations

import itertools
import pickle

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from merge_engine.layouts.dtensor_blocks import REPLICATE, SHARD, STRIDED_SHARD, Placement, local_block, placement_of
from merge_engine.formats.safe_unpickler import Record, record_class, safe_unpickle

OURS_AND_TORCH = (
    [(Placement(REPLICATE), Replicate())]
    + [(Placement(SHARD, d), Shard(d)) for d in (0, 1)]
    + [(Placement(STRIDED_SHARD, d, f), _StridedShard(d, split_factor=f)) for d in (0, 1) for f in (1, 2, 3)]
)


def _compare(shape, mesh, pairs) -> int:
    ours = [p for p, _ in pairs]
    theirs = [t for _, t in pairs]
    checked = 0
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        expected = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), theirs)
        expected = (tuple(int(n) for n in expected[0]), tuple(int(o) for o in expected[1]))
        assert local_block(shape, mesh, coordinate, ours) == expected, (shape, mesh, coordinate, ours)
        checked += 1
    return checked


def test_one_and_two_dim_meshes_match_torch_on_every_coordinate():
    checked = 0
    for shape in [(0, 3), (1, 1), (2, 5), (5, 2), (7, 4), (12, 6)]:  # empty, smaller than a mesh, uneven, even
        for mesh in [(1,), (2,), (3,), (4,), (5,)]:
            for pair in OURS_AND_TORCH:
                checked += _compare(shape, mesh, [pair])
        for mesh in [(2, 3), (3, 2)]:
            for pairs in itertools.product(OURS_AND_TORCH, repeat=2):
                checked += _compare(shape, mesh, list(pairs))
    assert checked > 5_000


def test_three_dim_meshes_match_torch():
    pairs = [OURS_AND_TORCH[i] for i in (0, 1, 2, 4, 6)]  # Replicate, Shard(0), Shard(1), SS(0, 2), SS(1, 1)
    for shape in [(7, 5), (12, 8)]:
        for combo in itertools.product(pairs, repeat=3):
            _compare(shape, (2, 2, 2), list(combo))


def test_fsdp2_over_tensor_parallel_blocks():
    """FSDP2 x TP (mesh dp x tp = 2 x 2): a column-wise weight is (_StridedShard(0, 2), Shard(0)) and each
    rank holds one contiguous quarter, in the order dp-major of the TP halves."""
    placements = [Placement(STRIDED_SHARD, 0, 2), Placement(SHARD, 0)]
    blocks = {c: local_block((8, 4), (2, 2), c, placements) for c in itertools.product(range(2), range(2))}
    assert blocks == {(0, 0): ((2, 4), (0, 0)), (1, 0): ((2, 4), (2, 0)),
                      (0, 1): ((2, 4), (4, 0)), (1, 1): ((2, 4), (6, 0))}


def test_a_long_dim_stays_a_few_runs():
    shape, mesh = (1_000_003, 8), (4, 2)
    placements = [Placement(STRIDED_SHARD, 0, 3), Placement(STRIDED_SHARD, 0, 2)]
    for coordinate in itertools.product(range(4), range(2)):
        local, offset = local_block(shape, mesh, coordinate, placements)
        assert 0 < local[0] < shape[0] and offset[0] < shape[0]


def test_a_shard_dim_beyond_the_tensor_is_refused():
    with pytest.raises(ValueError, match="sharding dim 2"):
        local_block((4, 4), (2,), (0,), [Placement(SHARD, 2)])


def _record(qualname: str, args=(), fields=None) -> Record:
    record = record_class("torch.distributed.tensor.placement_types", qualname)(*args)
    record.__setstate__(dict(fields or {}))
    return record


def test_placements_pickled_by_torch_are_read_from_records():
    """The records the allow-list unpickler makes of torch's own pickled placements (no torch code run)."""
    for ours, theirs in OURS_AND_TORCH:
        record = safe_unpickle(pickle.dumps(theirs), "mem://placement")
        assert isinstance(record, Record)
        assert placement_of(record) == ours


@pytest.mark.parametrize("record, expected", [
    (("Shard", (0,), {}), Placement(SHARD, 0)),
    (("Shard", (), {"dim": 1}), Placement(SHARD, 1)),
    (("_StridedShard", (), {"dim": 0, "split_factor": 2}), Placement(STRIDED_SHARD, 0, 2)),
    (("Replicate", (), {}), Placement(REPLICATE)),
    (("Partial", (), {"reduce_op": "sum"}), None),
    (("Shard", (), {}), None),
    (("Shard", (True,), {}), None),
    (("Shard", (-1,), {}), None),
    (("_StridedShard", (), {"dim": 0}), None),
    (("_StridedShard", (), {"dim": 0, "split_factor": 0}), None),
])
def test_placement_records(record, expected):
    assert placement_of(_record(*record)) == expected


def test_placements_print_as_torch_prints_them():
    assert [repr(p) for p, _ in OURS_AND_TORCH[:4]] == [repr(t) for _, t in OURS_AND_TORCH[:4]]
