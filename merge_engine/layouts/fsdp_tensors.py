"""verl FSDP rank files' values for one key -> the full tensor they are shards of (lazy, no byte read).

`assemble(key, values, archives)`: ``values`` are that key's value in each rank file (rank order), as
stepmerge's unpickler gives them (`merge_engine.formats.safe_unpickler`): DTensors (placements and mesh
coordinate decide each rank's block, as torch computes it), ShardedTensors (local shards with
offsets), or plain tensors (replicated: taken once). The result is a `merge_engine.formats.tensor_source`
lazy tensor whose pieces are the ranks' stored bytes; blocks that leave a gap or overlap, ranks that
disagree on shape, dtype or placement, and placements other than ``Shard`` / ``_StridedShard`` /
``Replicate`` are `CorruptShard` / `UnsupportedLayout` naming the rank file. The layout itself (names,
completeness, which files to open) is `merge_engine.layouts.fsdp`.
"""

from __future__ import annotations

import math
from typing import Any

from merge_engine.errors import CorruptShard, UnsupportedLayout
from merge_engine.formats.dtype_names import PickledDType
from merge_engine.layouts.dtensor_blocks import Placement, local_block, placement_of
from merge_engine.formats.tensor_source import ConcatTensor, ReplicatedTensor, StackedTensor
from merge_engine.formats.stored_tensor import StoredTensor
from merge_engine.formats.torch_archive import TorchArchive
from merge_engine.formats.safe_unpickler import WrapperTensor


def assemble(key: str, values: list[Any], archives: list[TorchArchive]):
    """The full tensor behind one key, from its per-rank values (see module docstring)."""
    kinds = {_kind(v) for v in values}
    if len(kinds) != 1:
        raise CorruptShard(f"{key!r} is stored differently on different ranks ({sorted(kinds)})", archives[0].url)
    kind = kinds.pop()
    if kind == "tensor":
        return ReplicatedTensor(tuple(values))
    if kind == "dtensor":
        return _assemble_dtensor(key, values, archives)
    if kind == "sharded_tensor":
        return _assemble_sharded_tensor(key, values, archives)
    raise UnsupportedLayout(f"{key!r} holds a {type(values[0]).__name__}, not a tensor", archives[0].url)


def _kind(value: Any) -> str:
    if isinstance(value, StoredTensor):
        return "tensor"
    if isinstance(value, WrapperTensor) and value.cls.qualname == "DTensor":
        return "dtensor"
    if isinstance(value, WrapperTensor) and value.cls.qualname == "ShardedTensor":
        return "sharded_tensor"
    return type(value).__name__


def _placement(record: Any, key: str, url: str) -> Placement:
    """The placement a pickled placement record stands for (Shard, _StridedShard, Replicate)."""
    found = placement_of(record)
    if found is None:
        name = getattr(record, "qualname", type(record).__name__)
        raise UnsupportedLayout(f"DTensor {key!r} has placement {name}; supported: Shard, _StridedShard, Replicate",
                                url)
    return found


def _assemble_dtensor(key: str, values: list[WrapperTensor], archives: list[TorchArchive]):
    """Each rank's block of the global tensor from its placements and mesh coordinate (torch's own
    `_compute_local_shape_and_global_offset`, recomputed by `merge_engine.layouts.dtensor_blocks`, so
    `Shard`, `_StridedShard` (FSDP2 over tensor parallelism) and `Replicate` on any number of mesh
    dims mean what they mean to torch). Ranks
    holding the same block are replicas (HSDP, a sub-mesh replicated over "tp"): each block must be
    held the same number of times, and its first holder is read. The blocks must tile the tensor:
    cut along one dim (`ConcatTensor`) or along dim 0 and one other (bands: `StackedTensor`)."""
    shape, dtype = tuple(values[0].shape), values[0].dtype_name  # a name: a check imports no torch
    records = []
    for rank, (value, archive) in enumerate(zip(values, archives)):
        spec = value.state.get("_spec")
        local = value.state.get("_local_tensor")
        if spec is None or not isinstance(local, StoredTensor):
            raise CorruptShard(f"DTensor {key!r} without spec or local tensor", archive.url)
        if tuple(value.shape) != shape or value.dtype_name != dtype:
            raise CorruptShard(f"DTensor {key!r} global shape {value.shape} differs from rank 0's {shape}", archive.url)
        mesh = spec.fields["mesh"].fields
        names = tuple(mesh.get("_mesh_dim_names") or ())
        coordinate = mesh.get("_coordinate_on_dim")
        if coordinate is None:
            if len(names) > 1:
                raise UnsupportedLayout(f"DTensor {key!r}: mesh without recorded coordinates", archive.url)
            coordinate = (rank,)
        placements = tuple(_placement(p, key, archive.url) for p in spec.fields["placements"])
        if len(placements) != len(coordinate) or not all(isinstance(c, int) and c >= 0 for c in coordinate):
            raise CorruptShard(f"DTensor {key!r}: {len(placements)} placements for mesh coordinate {coordinate}",
                               archive.url)
        records.append((archive, tuple(coordinate), placements, local))
    if len({r[2] for r in records}) > 1:
        raise CorruptShard(f"DTensor {key!r} is placed differently on different ranks", archives[0].url)
    mesh_shape = tuple(max(r[1][m] for r in records) + 1 for m in range(len(records[0][1])))
    blocks: dict[tuple[tuple[int, ...], tuple[int, ...]], list[StoredTensor]] = {}
    for archive, coordinate, placements, local in records:
        try:
            local_shape, offset = local_block(shape, mesh_shape, coordinate, placements)
        except ValueError as exc:
            raise CorruptShard(f"DTensor {key!r} of shape {shape}: {exc}", archive.url) from None
        if tuple(local.shape) != local_shape:
            raise CorruptShard(f"DTensor {key!r}: this rank holds {tuple(local.shape)} where its placement "
                               f"{placements} at {coordinate} says {local_shape}", archive.url)
        if math.prod(local_shape):
            blocks.setdefault((offset, local_shape), []).append(local)
    if len({len(held) for held in blocks.values()}) > 1:
        raise CorruptShard(f"ranks hold the shards of {key!r} unevenly (a rank file copied or missing?)",
                           archives[0].url)
    pieces = sorted((offset, local_shape, held[0]) for (offset, local_shape), held in blocks.items())
    if not pieces:
        return ConcatTensor(shape, dtype, 0, ())
    cut = [d for d in range(len(shape)) if len({p[0][d] for p in pieces}) > 1]
    if not cut:
        return ReplicatedTensor((pieces[0][2],))
    if len(cut) == 1:
        return ConcatTensor(shape, dtype, cut[0], _in_order(key, pieces, cut[0], archives[0].url))
    if len(cut) == 2 and cut[0] == 0:
        bands = []
        for row in sorted({p[0][0] for p in pieces}):
            band = [p for p in pieces if p[0][0] == row]
            rows = {p[1][0] for p in band}
            if len(rows) != 1:
                raise CorruptShard(f"blocks of {key!r} at row {row} differ in height {sorted(rows)}", archives[0].url)
            band_shape = (rows.pop(), *shape[1:])
            bands.append(ConcatTensor(band_shape, dtype, cut[1], _in_order(key, band, cut[1], archives[0].url)))
        _in_order(key, [((b_offset,), (band.shape[0],), None) for b_offset, band in
                        zip(sorted({p[0][0] for p in pieces}), bands)], 0, archives[0].url)
        return StackedTensor(shape, dtype, tuple(bands))
    raise UnsupportedLayout(f"DTensor {key!r} is cut along dims {cut}; supported: one dim, or dim 0 and one other",
                            archives[0].url)


def _in_order(key: str, pieces: list, dim: int, url: str) -> tuple[StoredTensor, ...]:
    """The pieces along ``dim`` in offset order, each starting where the previous one ends."""
    at = 0
    for offset, local_shape, _ in sorted(pieces, key=lambda p: p[0][dim]):
        if offset[dim] != at:
            raise CorruptShard(f"shards of {key!r} leave a gap or overlap at {at} along dim {dim}", url)
        at += local_shape[dim]
    return tuple(p[2] for p in sorted(pieces, key=lambda p: p[0][dim]))


def _assemble_sharded_tensor(key: str, values: list[WrapperTensor], archives: list[TorchArchive]):
    pieces: list[tuple[list[int], StoredTensor]] = []
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    for value, archive in zip(values, archives):
        state = value.state.get("__state__")
        if not isinstance(state, tuple) or len(state) < 2:
            raise CorruptShard(f"ShardedTensor {key!r} without its pickled shards", archive.url)
        local_shards, metadata = state[0], state[1]
        meta = metadata.fields
        size = tuple(int(s) for s in meta["size"])
        props = meta["tensor_properties"].fields
        if shape is None:
            shape, dtype = size, props.get("dtype")
        elif size != shape:
            raise CorruptShard(f"ShardedTensor {key!r} global size {size} differs from rank 0's {shape}", archive.url)
        for shard in local_shards:
            offsets = [int(o) for o in shard.fields["metadata"].fields["shard_offsets"]]
            pieces.append((offsets, shard.fields["tensor"]))
    varying = {d for offsets, _ in pieces for d, o in enumerate(offsets) if o}
    if len(varying) > 1:
        raise UnsupportedLayout(f"ShardedTensor {key!r} is sharded on several dims {sorted(varying)}", archives[0].url)
    dim = varying.pop() if varying else 0
    pieces.sort(key=lambda p: p[0][dim] if p[0] else 0)
    at = 0
    for offsets, tensor in pieces:
        if offsets and offsets[dim] != at:
            raise CorruptShard(f"ShardedTensor {key!r}: shard at offset {offsets[dim]}, expected {at}",
                               tensor.archive.url)
        at += tensor.shape[dim] if tensor.shape else 1
    if pieces:
        stored_dtype = pieces[0][1].dtype_name
    elif isinstance(dtype, PickledDType):
        stored_dtype = dtype.name
    else:
        raise CorruptShard(f"ShardedTensor {key!r} has no shards and no recorded dtype", archives[0].url)
    assert shape is not None  # read from the first rank's value: a key comes from at least one rank
    return ConcatTensor(shape, stored_dtype, dim, tuple(t for _, t in pieces))
