"""A torch.distributed.checkpoint (DCP) folder's index: ``.metadata`` parsed and checked, no process group, no torch.

``.metadata`` is a pickle: every entry's global shape and dtype, the N-d chunks it was saved in, and where
each chunk's bytes are (file, offset, length). `read_index` parses it with stepmerge's allow-list unpickler
(`merge_engine.formats.safe_unpickler.safe_unpickle`: torch's own ``FileSystemReader.read_metadata`` calls
``pickle.load`` on it, which would run any code a crafted file asks for) into a `DcpIndex`; every tensor's
chunks must tile it exactly, no gap and no overlap (`tiling_problem`), and no two items may share bytes, else
`CorruptShard`: element counts alone let a chunk listed twice hide a gap.
"""

from __future__ import annotations

import bisect
import math
import reprlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy

from merge_engine import storage
from merge_engine.formats.dcp_file_names import METADATA_FILE
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.formats.dtype_names import ITEMSIZES, DTypeByName, PickledDType, name_of
from merge_engine.formats.safe_unpickler import Record, safe_unpickle

MAX_METADATA_BYTES = 1 << 30  # an index of chunks and offsets; the weights live in the data files


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item's bytes are: data file (relative), byte offset and length."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class ChunkInfo:
    """One saved N-d chunk of a global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ItemLocation


@dataclass(frozen=True)
class TensorInfo(DTypeByName):
    """A global tensor of the index: shape, dtype by name (``dtype``: the ``torch.dtype``) and its chunks."""

    shape: tuple[int, ...]
    dtype_name: str
    chunks: tuple[ChunkInfo, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", name_of(self.dtype_name))

    @cached_property
    def _rows_index(self) -> tuple[list[int], list[ChunkInfo], int]:
        order = sorted(self.chunks, key=lambda c: c.offsets[0])
        return [c.offsets[0] for c in order], order, max((c.sizes[0] for c in order), default=0)

    def chunks_meeting(self, start: int, stop: int) -> Sequence[ChunkInfo]:
        """The chunks whose dim-0 range meets ``[start, stop)`` (all chunks of a scalar), found by
        bisection: reading one layer of a stacked tensor does not scan every layer's chunks."""
        if not self.shape:
            return self.chunks
        starts, order, tallest = self._rows_index
        found = order[bisect.bisect_left(starts, start - tallest + 1):bisect.bisect_left(starts, stop)]
        return [c for c in found if c.offsets[0] + c.sizes[0] > start]


@dataclass(frozen=True)
class DcpIndex:
    """What ``.metadata`` says: tensors (with their chunks) and bytes entries, by key; ``paths``: each flattened
    key's path in the nested state dict that was saved (DCP's default planner records it as ``planner_data``:
    ``"model.lm_head.weight"`` -> ``("model", "lm_head.weight")``), empty when the metadata records none."""

    url: str
    tensors: dict[str, TensorInfo]
    objects: dict[str, ItemLocation]
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def files(self) -> set[str]:
        names = {c.location.file for t in self.tensors.values() for c in t.chunks}
        return names | {loc.file for loc in self.objects.values()}


def _fields(value: Any) -> dict[str, Any]:
    return value.fields if isinstance(value, Record) else {}


def _dtype_of(properties: Any, url: str, key: str) -> str:
    """The name of the dtype the metadata records for ``key`` (a pickled ``torch.<dtype>`` global)."""
    state = properties.state if isinstance(properties, Record) else None
    dtype = state[0] if isinstance(state, tuple) and state else _fields(properties).get("dtype")
    if not isinstance(dtype, PickledDType):
        raise CorruptShard(f"no dtype recorded for {key!r}", url)
    return dtype.name


def read_index(url: str, *, layout: str | None = None) -> DcpIndex:
    """Parse ``<url>/.metadata`` safely; `IncompleteCheckpoint` if absent, `CorruptShard` if malformed,
    `UnsupportedLayout` for items saved through a stream transform (compressed), its message starting with
    ``layout`` (the name of the layout reading it) where given, as that layout's own refusals do.

    Besides the tiling, the index is refused when it lies about bytes: negative or non-integer
    offsets and sizes, two items sharing bytes of a data file (one saved chunk standing for many),
    or a tensor chunk whose item is too short to hold the chunk's elements. With the data files'
    sizes checked against the items (`megatron_dist._check_files`, `_Window`), a tensor never claims
    more bytes than the files hold.
    """
    meta_url = storage.join(url, METADATA_FILE)
    try:
        reader = storage.RangeReader(meta_url)
    except (FileNotFoundError, IncompleteCheckpoint):
        raise IncompleteCheckpoint(f"{METADATA_FILE} missing (the save did not finish)", meta_url) from None
    try:
        if reader.size > MAX_METADATA_BYTES:
            raise CorruptShard(f"{reader.size} bytes: larger than any checkpoint index ({MAX_METADATA_BYTES})",
                               meta_url)
        data = reader.read(0, reader.size)
    finally:
        reader.close()
    root = safe_unpickle(data, meta_url)
    fields = _fields(root)
    if getattr(root, "qualname", "") != "Metadata" or "state_dict_metadata" not in fields:
        raise CorruptShard("not a torch.distributed.checkpoint metadata file", meta_url)
    try:
        return _parse_index(url, fields, meta_url, f"{layout}: " if layout else "")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field missing or of the wrong kind
        raise CorruptShard(f"metadata entry malformed ({type(exc).__name__}: {exc})", meta_url) from None


def _parse_index(url: str, fields: dict, meta_url: str, prefix: str) -> DcpIndex:
    locations: dict[tuple[str | None, tuple[int, ...] | None], ItemLocation] = {}
    for index, info in (fields.get("storage_data") or {}).items():
        idx, loc = _fields(index), _fields(info)
        if loc.get("transform_descriptors"):
            raise UnsupportedLayout(f"{prefix}{idx.get('fqn')!r} is stored with transforms "
                                    f"{loc['transform_descriptors']} (compression?); not supported", meta_url)
        offset = idx.get("offset")
        location = ItemLocation(_file_name(loc["relative_path"]), _count(loc["offset"]), _count(loc["length"]))
        locations[(idx.get("fqn"), tuple(_count(o) for o in offset) if offset is not None else None)] = location
    _check_items_disjoint(locations.values(), meta_url)
    tensors, objects = {}, {}
    for key, entry in fields["state_dict_metadata"].items():
        kind = getattr(entry, "qualname", "")
        if kind == "BytesStorageMetadata":
            if (key, None) in locations:
                objects[key] = locations[(key, None)]
            continue
        if kind != "TensorStorageMetadata":
            raise CorruptShard(f"{key!r}: unknown metadata entry {kind}", meta_url)
        entry_fields = _fields(entry)
        shape = tuple(_count(s) for s in entry_fields["size"])
        dtype = _dtype_of(entry_fields["properties"], meta_url, key)
        chunks = []
        for chunk in entry_fields["chunks"]:
            c = _fields(chunk)
            offsets, sizes = tuple(_count(x) for x in c["offsets"]), tuple(_count(x) for x in c["sizes"])
            found = locations.get((key, offsets))
            if found is None:
                raise CorruptShard(f"{key!r}: chunk at {offsets} has no storage entry", meta_url)
            location = found
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, shape)):
                raise CorruptShard(f"{key!r}: chunk {offsets}+{sizes} lies outside {shape}", meta_url)
            if location.length < math.prod(sizes) * ITEMSIZES[dtype]:
                raise CorruptShard(f"{key!r}: chunk {sizes} needs {math.prod(sizes) * ITEMSIZES[dtype]} bytes, its "
                                   f"item at {location.offset} of {location.file} has {location.length}", meta_url)
            chunks.append(ChunkInfo(offsets, sizes, location))
        problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
        if problem:
            raise CorruptShard(f"{key!r} {shape}: its saved {problem}", meta_url)
        tensors[key] = TensorInfo(shape, dtype, tuple(chunks))
    return DcpIndex(url, tensors, objects, _planner_paths(fields.get("planner_data")))


def _planner_paths(value: Any) -> dict[str, tuple[str, ...]]:
    """DCP's flattening record (flattened key -> the keys of its path); {} for anything else a planner stored."""
    if not isinstance(value, dict):
        return {}
    paths = {}
    for key, path in value.items():
        if not isinstance(key, str) or not isinstance(path, tuple) or not path \
                or not all(isinstance(part, str) for part in path):
            return {}
        paths[key] = path
    return paths


def _count(value: Any) -> int:
    """A non-negative integer from the metadata (an offset, a size, a length), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_short(value)} is not a non-negative integer")
    return value


def _file_name(value: Any) -> str:
    """A data file's name as DCP writes it (``__0_0.distcp``): one plain name inside the folder."""
    if not isinstance(value, str) or not value or value.startswith(".") or any(
            c in value for c in "/\\") or not value.isprintable():
        raise ValueError(f"data file name {_short(value)} is not a plain file name in the folder")
    return value


def _short(value: Any) -> str:
    return reprlib.repr(value)


def _check_items_disjoint(locations: Iterable[ItemLocation], meta_url: str) -> None:
    """No two saved items share a byte of a data file: each item is one chunk's (or object's) bytes."""
    by_file: dict[str, list[ItemLocation]] = {}
    for location in locations:
        by_file.setdefault(location.file, []).append(location)
    for name, items in by_file.items():
        end = 0
        for item in sorted(items, key=lambda i: (i.offset, i.length)):
            if item.offset < end:
                raise CorruptShard(f"two items share bytes {item.offset}-{end} of {name}", meta_url)
            end = item.offset + item.length


MAX_GRID_CELLS = 1 << 22  # above this the tiling check compares chunks pairwise instead of marking a grid


def tiling_problem(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """None when the boxes ``(offsets, sizes)`` (inside ``shape``) cover it exactly once, else what is wrong
    ("chunks overlap ...", "chunks do not cover ...").

    Counting elements is not enough (a chunk listed twice hides a gap of the same size). The
    boxes' borders cut every dim into intervals; each box covers a block of the resulting grid
    cells, and the boxes tile the shape iff every cell is covered exactly once. A grid too large
    to mark (crafted metadata) falls back to a pairwise overlap test plus the element count.
    """
    boxes = [(tuple(o), tuple(s)) for o, s in boxes if all(s)]  # an empty chunk holds nothing
    total = math.prod(shape)
    if not shape or not total:
        return None if len(boxes) == (1 if total else 0) else f"chunks cover its {total} element(s) {len(boxes)} times"
    cuts = [sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) <= MAX_GRID_CELLS:
        position = [{x: i for i, x in enumerate(c)} for c in cuts]
        count = numpy.zeros([len(c) - 1 for c in cuts], dtype=numpy.int32)
        for offsets, sizes in boxes:
            count[tuple(slice(p[o], p[o + s]) for p, o, s in zip(position, offsets, sizes))] += 1
        if bool((count > 1).any()):
            return f"chunks overlap (the element at {_first_index(count > 1, cuts)} is saved twice)"
        if bool((count == 0).any()):
            return f"chunks do not cover the element at {_first_index(count == 0, cuts)}"
        return None
    pair = _overlapping_pair(boxes)
    if pair is not None:
        return f"chunks overlap (those at {boxes[pair[0]][0]} and {boxes[pair[1]][0]})"
    covered = sum(math.prod(s) for _, s in boxes)
    return None if covered == total else f"chunks do not cover it ({covered} of {total} elements)"


def _first_index(mask: numpy.ndarray, cuts: Sequence[Sequence[int]]) -> tuple[int, ...]:
    cell = numpy.argwhere(mask)[0].tolist()  # row-major order, as torch's nonzero
    return tuple(c[i] for c, i in zip(cuts, cell))


def _overlapping_pair(boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int] | None:
    """Two boxes sharing an element, by a sweep over dim 0 (only boxes open together are compared)."""
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        offsets, sizes = boxes[i]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > offsets[0]]
        for j in active:
            o, s = boxes[j]
            if all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(offsets[1:], sizes[1:], o[1:], s[1:])):
                return j, i
        active.append(i)
    return None
