"""Which block of a DTensor's global tensor a rank holds, from the placement records its rank file
pickles, computed as torch computes it, without importing ``torch.distributed.tensor``.

torch's answer (``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``) costs the
imports of sympy and the DTensor op tables for a few integer divisions (docs/scaling.md, "Figures behind
the engine's choices"). The placements are read by the allow-list unpickler
(`merge_engine.formats.safe_unpickler`) as inert records; this module turns them into `Placement` values and
does the arithmetic.

Contract:
- `placement_of(record)` -> `Placement` for ``Shard(dim)``, ``_StridedShard(dim, split_factor)`` and
  ``Replicate()`` records; None for anything else (``Partial``, a custom placement, a malformed
  record): the caller refuses it.
- `local_block(global_shape, mesh_shape, coordinate, placements)` -> (local shape, global offset of the
  block's first element per dim): the values torch's function returns for the same arguments, for
  every shape, mesh and coordinate (`tests/merge_engine/layouts/test_dtensor_blocks.py` compares them
  on every small case). Sharding is applied mesh dim by mesh dim, left to right: ``Shard`` keeps
  chunk ``c`` of ``torch.chunk``'s split (chunk size ceil(n / k), trailing chunks empty);
  ``_StridedShard(split_factor=f)`` chunks into f pieces, chunks each piece into k and keeps chunk
  ``c`` of every piece, concatenated. A block that is empty along a dim has that dim's global size as
  its offset (torch's convention). Indices are kept as runs (``range``s), never one int per element.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

SHARD, STRIDED_SHARD, REPLICATE = "Shard", "_StridedShard", "Replicate"


@dataclass(frozen=True)
class Placement:
    """One mesh dim's placement: ``kind`` is ``Shard``, ``_StridedShard`` or ``Replicate``."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __repr__(self) -> str:  # torch's spelling, so messages read the same as before
        if self.kind == REPLICATE:
            return "Replicate()"
        if self.kind == STRIDED_SHARD:
            return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"
        return f"Shard(dim={self.dim})"


def placement_of(record: Any) -> Placement | None:
    """The `Placement` a pickled placement record (`merge_engine.formats.safe_unpickler.Record`) stands for;
    None when it is not ``Shard`` / ``_StridedShard`` / ``Replicate`` with sound fields."""
    name = getattr(record, "qualname", type(record).__name__)
    fields = getattr(record, "fields", None) or {}
    args = getattr(record, "args", None) or ()
    if name == REPLICATE:
        return Placement(REPLICATE)
    dim = fields.get("dim", args[0] if args else None)
    if name not in (SHARD, STRIDED_SHARD) or not _is_count(dim, 0):
        return None
    if name == SHARD:
        return Placement(SHARD, dim)
    split = fields.get("split_factor")
    return Placement(STRIDED_SHARD, dim, split) if _is_count(split, 1) else None


def _is_count(value: Any, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


Runs = tuple[range, ...]  # a sequence of indices as consecutive runs


def _chunk(size: int, chunks: int, index: int) -> range:
    """Chunk ``index`` of ``torch.chunk(range(size), chunks)``, empty where torch has none."""
    step = -(-size // chunks)
    return range(min(step * index, size), min(step * (index + 1), size))


def _own_indices(placement: Placement, size: int, chunks: int, index: int) -> Runs:
    """The positions, within a dim of ``size``, that chunk ``index`` of ``chunks`` keeps."""
    if placement.kind == SHARD:
        return (_chunk(size, chunks, index),)
    runs = []
    for piece in range(placement.split_factor):
        outer = _chunk(size, placement.split_factor, piece)
        inner = _chunk(len(outer), chunks, index)
        runs.append(range(outer.start + inner.start, outer.start + inner.stop))
    return tuple(runs)


def _take(previous: Runs | None, index: Runs) -> Runs:
    """``previous[index]``: the elements of the run sequence ``previous`` at the positions ``index``."""
    if previous is None:
        return tuple(r for r in index if r)
    starts, at = [], 0
    for run in previous:
        starts.append(at)
        at += len(run)
    out = []
    for wanted in index:
        pos = wanted.start
        while pos < wanted.stop:
            i = bisect.bisect_right(starts, pos) - 1
            run = previous[i]
            skip = pos - starts[i]
            count = min(wanted.stop - pos, len(run) - skip)
            out.append(range(run.start + skip, run.start + skip + count))
            pos += count
    return tuple(out)


def local_block(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Placement]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the block the rank at ``coordinate`` holds (module docstring)."""
    local = list(global_shape)
    positions: dict[int, Runs] = {}
    for mesh_dim, placement in enumerate(placements):
        if placement.kind == REPLICATE:
            continue
        dim = placement.dim
        if dim >= len(local):
            raise ValueError(f"sharding dim {dim} is beyond a tensor of {len(local)} dims")
        index = _own_indices(placement, local[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        size = sum(len(r) for r in index)
        local[dim] = size
        if size == 0:
            positions[dim] = (range(global_shape[dim], global_shape[dim] + 1),)
        else:
            positions[dim] = _take(positions.get(dim), index)
    offset = [0] * len(global_shape)
    for dim, runs in positions.items():
        offset[dim] = runs[0].start
    return tuple(local), tuple(offset)
