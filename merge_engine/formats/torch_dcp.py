"""torch.distributed.checkpoint (DCP) folders, read and written without a process group or a GPU.

A DCP folder holds ``.metadata`` (a pickle: every entry's global shape and dtype, the N-d chunks
it was saved in, and where each chunk's bytes are: file, offset, length) and data files
``__<rank>_<n>.distcp`` that are plain concatenations of items. A tensor chunk's item is a
complete ``torch.save`` archive of that chunk; a bytes entry's item is its raw bytes.

Reading (`read_index`, `DcpTensor`):
- ``.metadata`` is parsed by stepmerge's allow-list unpickler (`safe_unpickle`): torch's own
  ``FileSystemReader.read_metadata`` calls ``pickle.load`` on it, which would run any code a
  crafted file asks for;
- every tensor's chunks must tile it exactly, no gap and no overlap (`tiling_problem`), else
  `CorruptShard`: element counts alone let a chunk listed twice hide a gap;
- a chunk's archive is opened on first use, over a window of its data file (ranged reads only);
- `DcpTensor` is a box of a global tensor (some leading indices fixed, e.g. one layer of a
  stacked ``[layers, ...]`` tensor): it reads exactly the chunk regions that intersect it.

Writing (`DcpDataFile`, one per job, then `dcp_metadata_bytes` of all their items): items are appended
to a data file, each tensor chunk as its own ``torch.save`` archive; ``.metadata`` is written last with torch's own record classes, so
``torch.distributed.checkpoint`` and megatron-core load the result.
"""

from __future__ import annotations

import bisect
import io
import math
import pickle
import reprlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy

from merge_engine import storage
from merge_engine.formats.dcp_file_names import DATA_FILE, METADATA_FILE
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.formats.dtype_names import ITEMSIZES, DTypeByName, PickledDType, describe, name_of
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES
from merge_engine.formats.safe_unpickler import Record, safe_unpickle
from merge_engine.formats.stored_tensor import StoredTensor
from merge_engine.formats.torch_archive import TorchArchive

if TYPE_CHECKING:  # reading ``.metadata`` (a check) needs no torch; the chunk reads and the writer import it
    import torch

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
    """What ``.metadata`` says: tensors (with their chunks) and bytes entries, by key."""

    url: str
    tensors: dict[str, TensorInfo]
    objects: dict[str, ItemLocation]

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


def read_index(url: str) -> DcpIndex:
    """Parse ``<url>/.metadata`` safely; `IncompleteCheckpoint` if absent, `CorruptShard` if malformed.

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
        return _parse_index(url, fields, meta_url)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field missing or of the wrong kind
        raise CorruptShard(f"metadata entry malformed ({type(exc).__name__}: {exc})", meta_url) from None


def _parse_index(url: str, fields: dict, meta_url: str) -> DcpIndex:
    locations: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
    for index, info in (fields.get("storage_data") or {}).items():
        idx, loc = _fields(index), _fields(info)
        if loc.get("transform_descriptors"):
            raise UnsupportedLayout(f"{idx.get('fqn')!r} is stored with transforms {loc['transform_descriptors']} "
                                    "(compression?); not supported", meta_url)
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
            location = locations.get((key, offsets))
            if location is None:
                raise CorruptShard(f"{key!r}: chunk at {offsets} has no storage entry", meta_url)
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
    return DcpIndex(url, tensors, objects)


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


def _overlapping_pair(boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, int] | None:
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


class _Window:
    """A `RangeReader`-like view of ``[offset, offset + length)`` of another reader (one item)."""

    def __init__(self, reader: storage.RangeReader, offset: int, length: int) -> None:
        self._reader, self._offset, self.size = reader, offset, length

    def _bounded(self, offset: int, length: int) -> int:
        if offset < 0 or offset + length > self.size:
            raise CorruptShard(f"read of {length} bytes at {offset} leaves the {self.size}-byte item at "
                               f"{self._offset}", self._reader.url)
        return self._offset + offset

    def read(self, offset: int, length: int) -> bytes:
        return self._reader.read(self._bounded(offset, length), length)

    def read_into(self, offset: int, buffer) -> None:
        self._reader.read_into(self._bounded(offset, memoryview(buffer).nbytes), buffer)

    def close(self) -> None:  # the data file's reader is closed by `DcpFiles`
        pass


class DcpFiles:
    """The data files of one DCP folder, opened on first use; chunk archives cached by location."""

    def __init__(self, url: str, sizes: Mapping[str, int], versions: Mapping[str, str] | None = None) -> None:
        self.url = url
        self._sizes = dict(sizes)
        self._versions = dict(versions or {})  # listed versions: reads pinned to them (`storage.RangeReader`)
        self._readers: dict[str, storage.RangeReader] = {}
        self._chunks: dict[ItemLocation, StoredTensor] = {}

    def chunk(self, location: ItemLocation, key: str, info: ChunkInfo, dtype: str) -> StoredTensor:
        """The saved chunk at ``location`` (``dtype``: the metadata's dtype name, which it must hold)."""
        stored = self._chunks.get(location)
        if stored is None:
            file_url = storage.join(self.url, location.file)
            reader = self._readers.get(location.file)
            if reader is None:
                reader = self._readers[location.file] = self._open(file_url, location.file)
            archive = TorchArchive(f"{file_url}@{location.offset}", _Window(reader, location.offset, location.length))
            stored = archive.load()
            if not isinstance(stored, StoredTensor) or stored.shape != info.sizes or stored.dtype_name != dtype:
                raise CorruptShard(f"{key!r}: item at {location.offset} is not the {info.sizes} {describe(dtype)} chunk the "
                                   "metadata describes", file_url)
            self._chunks[location] = stored
        return stored

    def _open(self, file_url: str, name: str) -> storage.RangeReader:
        size, version = self._sizes.get(name), self._versions.get(name)
        return storage.RangeReader(file_url, size, version if size is not None else None)

    def read_object(self, location: ItemLocation) -> bytes:
        reader = self._readers.get(location.file)
        if reader is None:
            file_url = storage.join(self.url, location.file)
            reader = self._readers[location.file] = self._open(file_url, location.file)
        return reader.read(location.offset, location.length)

    def verify_reads(self) -> None:
        """The CRC-32 of every item record read from (each item is a ``torch.save`` archive)."""
        for stored in list(self._chunks.values()):
            stored.archive.verify_reads()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._chunks.clear()


@dataclass(frozen=True)
class DcpTensor:
    """The box of a global DCP tensor with its leading indices fixed to ``lead`` (may be empty).

    Behaves as an assembly (`shape`, `dtype`, `iter_chunks`, `read`) for `AssembledSource`.
    """

    key: str
    info: TensorInfo
    files: DcpFiles = field(compare=False, repr=False)
    lead: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape[len(self.lead):]

    @property
    def dtype(self) -> torch.dtype:
        return self.info.dtype

    @property
    def dtype_name(self) -> str:
        return self.info.dtype_name

    def read_box(self, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """Elements ``[starts, starts + sizes)`` of this box (coordinates relative to it)."""
        import torch

        g_starts = tuple(self.lead) + tuple(starts)
        g_sizes = (1,) * len(self.lead) + tuple(sizes)
        regions = []  # (chunk, low corner, high corner) of every chunk meeting the box
        meeting = self.info.chunks_meeting(g_starts[0], g_starts[0] + g_sizes[0]) if g_sizes else self.info.chunks
        for chunk in meeting:
            lo = [max(a, c) for a, c in zip(g_starts, chunk.offsets)]
            hi = [min(a + n, c + s) for a, n, c, s in zip(g_starts, g_sizes, chunk.offsets, chunk.sizes)]
            if all(l < h for l, h in zip(lo, hi)):
                regions.append((chunk, lo, hi))
        problem = tiling_problem(g_sizes, [([l - a for l, a in zip(lo, g_starts)], [h - l for l, h in zip(lo, hi)])
                                           for _, lo, hi in regions])
        if problem:  # checked before reading: a hole would otherwise come back as uninitialised memory
            raise CorruptShard(f"{self.key!r}, box {g_sizes} at {g_starts}: its saved {problem}",
                               self.files.url)
        if len(regions) == 1:  # the box lies in one saved chunk: no second buffer
            chunk, lo, hi = regions[0]
            stored = self.files.chunk(chunk.location, self.key, chunk, self.dtype_name)
            return _read_region(stored, [l - c for l, c in zip(lo, chunk.offsets)],
                                [h - l for l, h in zip(lo, hi)]).reshape(tuple(sizes))
        out = torch.empty(g_sizes, dtype=self.dtype)  # every element is written: the regions tile the box
        for chunk, lo, hi in regions:
            stored = self.files.chunk(chunk.location, self.key, chunk, self.dtype_name)
            region = _read_region(stored, [l - c for l, c in zip(lo, chunk.offsets)], [h - l for l, h in zip(lo, hi)])
            out[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, g_starts))] = region
            del region
        return out.reshape(tuple(sizes))

    def read(self) -> torch.Tensor:
        return self.read_box((0,) * len(self.shape), self.shape)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Row-major flat pieces: runs of whole rows of dim 0 (one row when a row is larger)."""
        shape = self.shape
        if not shape:
            yield self.read().reshape(-1)
            return
        row_bytes = math.prod(shape[1:]) * ITEMSIZES[self.dtype_name]
        rows = max(1, max_bytes // max(row_bytes, 1))
        for start in range(0, shape[0], rows):
            count = min(rows, shape[0] - start)
            yield self.read_box((start,) + (0,) * (len(shape) - 1), (count, *shape[1:])).reshape(-1)

    def iter_range(self, start: int, count: int, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Elements ``[start, start+count)`` of the row-major flattening: the rows of dim 0 that hold them,
        read as boxes of whole rows (one row at least), cut to the range."""
        shape = self.shape
        if count <= 0:
            return
        if not shape:
            yield self.read().reshape(-1)[start:start + count]
            return
        row = math.prod(shape[1:])
        if row == 0:
            return
        rows = max(1, max_bytes // max(row * ITEMSIZES[self.dtype_name], 1))
        first, last = start // row, -(-(start + count) // row)
        for a in range(first, last, rows):
            b = min(last, a + rows)
            flat = self.read_box((a,) + (0,) * (len(shape) - 1), (b - a, *shape[1:])).reshape(-1)
            lo, hi = max(start, a * row) - a * row, min(start + count, b * row) - a * row
            yield flat[lo:hi]


def _read_region(stored: StoredTensor, lo: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """The sub-box ``[lo, lo + counts)`` of a saved chunk, read as a few contiguous runs.

    Dims after ``k`` are taken whole, so each index over the dims before ``k`` is one run of
    ``counts[k]`` rows of dim ``k`` (one run in all when only leading indices are fixed).
    """
    import torch

    shape = stored.shape
    if not shape:
        return stored.read()
    k = len(shape) - 1
    while k > 0 and lo[k] == 0 and counts[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = counts[k] * strides[k]
    out = torch.empty(tuple(counts), dtype=stored.dtype)
    flat_out = out.reshape(-1)
    at = 0
    for index in _indices(lo[:k], counts[:k]):
        start = sum(i * st for i, st in zip(index, strides)) + lo[k] * strides[k]
        stored.read_flat(start, run, flat_out[at:at + run])
        at += run
    return out


def _indices(lo: Sequence[int], counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not lo:
        yield ()
        return
    for first in range(lo[0], lo[0] + counts[0]):
        for rest in _indices(lo[1:], counts[1:]):
            yield (first, *rest)


# ------------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class DcpItem:
    """One item of a data file, as ``.metadata`` records it: a tensor chunk (``key``, its ``offsets`` in
    the global tensor, the global ``shape``, ``dtype`` and the chunk's ``sizes``) or a bytes entry
    (``offsets`` None), and where its bytes are (``file``, ``offset``, ``length``). Small, picklable:
    what a worker that wrote a data file hands back to the one that writes ``.metadata``."""

    key: str
    offsets: tuple[int, ...] | None
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    sizes: tuple[int, ...] | None
    file: str
    offset: int
    length: int


class DcpDataFile(storage.CommitOnExit):
    """One data file of a DCP folder, items appended (`add_chunk`, `add_object`), hashed as written.

    ``close()`` commits the file; ``items`` then lists what it holds (for `write_dcp_metadata`),
    ``size`` and ``sha256()`` describe it. Leaving a ``with`` block by an exception (or ``abort()``)
    leaves no file. Memory: one chunk's archive at a time.
    """

    def __init__(self, url: str, name: str = DATA_FILE) -> None:
        from merge_engine.storage.hashing_writer import HashingWriter

        self.name = name
        self._out = HashingWriter(storage.join(url, name))
        self.items: list[DcpItem] = []

    @property
    def size(self) -> int:
        return self._out.size

    def sha256(self) -> str:
        return self._out.sha256()

    def add_chunk(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], tensor: torch.Tensor) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save(tensor.detach().contiguous().clone(), buffer)
        at = self._out.size
        self._out.write(buffer.getbuffer())
        self.items.append(DcpItem(key, tuple(int(o) for o in offsets), tuple(int(s) for s in global_shape),
                                  tensor.dtype, tuple(tensor.shape), self.name, at, self._out.size - at))

    def add_object(self, key: str, data: bytes) -> None:
        at = self._out.size
        self._out.write(data)
        self.items.append(DcpItem(key, None, None, None, None, self.name, at, len(data)))

    def close(self) -> None:
        self._out.close()

    def abort(self) -> None:
        self._out.abort()


def dcp_metadata_bytes(items: Iterable[DcpItem]) -> bytes:
    """``.metadata`` (torch's own record classes, pickled) for ``items`` of any data files, in their order.

    Raises `ValueError` when two chunks of one key disagree on the global shape or dtype."""
    import torch

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    items = list(items)
    state: dict[str, Any] = {}
    storage_data = {}
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[DcpItem]]] = {}
    for item in items:
        index = MetadataIndex(item.key, torch.Size(item.offsets) if item.offsets is not None else None)
        storage_data[index] = _StorageInfo(item.file, item.offset, item.length)
        if item.offsets is None:
            state[item.key] = BytesStorageMetadata()
            continue
        entry = tensors.setdefault(item.key, (item.shape, item.dtype, []))
        if entry[0] != item.shape or entry[1] != item.dtype:
            raise ValueError(f"{item.key}: chunks disagree on global shape or dtype")
        entry[2].append(item)
    for key, (shape, dtype, chunks) in tensors.items():
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in chunks])
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage_data))


