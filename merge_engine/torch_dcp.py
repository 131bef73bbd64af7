"""torch.distributed.checkpoint (DCP) folders, read and written without a process group or a GPU.

A DCP folder holds ``.metadata`` (a pickle: every entry's global shape and dtype, the N-d chunks
it was saved in, and where each chunk's bytes are: file, offset, length) and data files
``__<rank>_<n>.distcp`` that are plain concatenations of items. A tensor chunk's item is a
complete ``torch.save`` archive of that chunk; a bytes entry's item is its raw bytes.

Reading (`read_index`, `DcpTensor`):
- ``.metadata`` is parsed by stepmerge's allow-list unpickler (`safe_unpickle`): torch's own
  ``FileSystemReader.read_metadata`` calls ``pickle.load`` on it, which would run any code a
  crafted file asks for;
- a chunk's archive is opened on first use, over a window of its data file (ranged reads only);
- `DcpTensor` is a box of a global tensor (some leading indices fixed, e.g. one layer of a
  stacked ``[layers, ...]`` tensor): it reads exactly the chunk regions that intersect it.

Writing (`DcpWriter`): items are appended to one data file, each tensor chunk as its own
``torch.save`` archive; ``.metadata`` is written last with torch's own record classes, so
``torch.distributed.checkpoint`` and megatron-core load the result.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.tensor_source import DEFAULT_CHUNK_BYTES
from merge_engine.torch_archive import Record, StoredTensor, TorchArchive, safe_unpickle

METADATA_FILE = ".metadata"
DATA_FILE = "__0_0.distcp"


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
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkInfo, ...]


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


def _dtype_of(properties: Any, url: str, key: str) -> torch.dtype:
    state = properties.state if isinstance(properties, Record) else None
    dtype = state[0] if isinstance(state, tuple) and state else _fields(properties).get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise CorruptShard(f"no dtype recorded for {key!r}", url)
    return dtype


def read_index(url: str) -> DcpIndex:
    """Parse ``<url>/.metadata`` safely; `IncompleteCheckpoint` if absent, `CorruptShard` if malformed."""
    meta_url = storage.join(url, METADATA_FILE)
    try:
        data = storage.read_bytes(meta_url)
    except FileNotFoundError:
        raise IncompleteCheckpoint(f"{METADATA_FILE} missing (the save did not finish)", meta_url) from None
    root = safe_unpickle(data, meta_url)
    fields = _fields(root)
    if getattr(root, "qualname", "") != "Metadata" or "state_dict_metadata" not in fields:
        raise CorruptShard("not a torch.distributed.checkpoint metadata file", meta_url)
    locations: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
    for index, info in (fields.get("storage_data") or {}).items():
        idx, loc = _fields(index), _fields(info)
        if loc.get("transform_descriptors"):
            raise UnsupportedLayout(f"{idx.get('fqn')!r} is stored with transforms {loc['transform_descriptors']} "
                                    "(compression?); not supported", meta_url)
        offset = idx.get("offset")
        locations[(idx.get("fqn"), tuple(offset) if offset is not None else None)] = ItemLocation(
            str(loc["relative_path"]), int(loc["offset"]), int(loc["length"]))
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
        shape = tuple(int(s) for s in entry_fields["size"])
        chunks = []
        for chunk in entry_fields["chunks"]:
            c = _fields(chunk)
            offsets, sizes = tuple(int(x) for x in c["offsets"]), tuple(int(x) for x in c["sizes"])
            location = locations.get((key, offsets))
            if location is None:
                raise CorruptShard(f"{key!r}: chunk at {offsets} has no storage entry", meta_url)
            if len(offsets) != len(shape) or any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                raise CorruptShard(f"{key!r}: chunk {offsets}+{sizes} lies outside {shape}", meta_url)
            chunks.append(ChunkInfo(offsets, sizes, location))
        if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
            raise CorruptShard(f"{key!r}: its chunks do not cover its global shape {shape} exactly", meta_url)
        tensors[key] = TensorInfo(shape, _dtype_of(entry_fields["properties"], meta_url, key), tuple(chunks))
    return DcpIndex(url, tensors, objects)


class _Window:
    """A `RangeReader`-like view of ``[offset, offset + length)`` of another reader (one item)."""

    def __init__(self, reader: storage.RangeReader, offset: int, length: int) -> None:
        self._reader, self._offset, self.size = reader, offset, length

    def read(self, offset: int, length: int) -> bytes:
        return self._reader.read(self._offset + offset, length)

    def read_into(self, offset: int, buffer) -> None:
        self._reader.read_into(self._offset + offset, buffer)

    def close(self) -> None:  # the data file's reader is closed by `DcpFiles`
        pass


class DcpFiles:
    """The data files of one DCP folder, opened on first use; chunk archives cached by location."""

    def __init__(self, url: str, sizes: Mapping[str, int]) -> None:
        self.url = url
        self._sizes = dict(sizes)
        self._readers: dict[str, storage.RangeReader] = {}
        self._chunks: dict[ItemLocation, StoredTensor] = {}

    def chunk(self, location: ItemLocation, key: str, info: ChunkInfo, dtype: torch.dtype) -> StoredTensor:
        stored = self._chunks.get(location)
        if stored is None:
            file_url = storage.join(self.url, location.file)
            reader = self._readers.get(location.file)
            if reader is None:
                reader = self._readers[location.file] = storage.RangeReader(file_url, self._sizes.get(location.file))
            archive = TorchArchive(f"{file_url}@{location.offset}", _Window(reader, location.offset, location.length))
            stored = archive.load()
            if not isinstance(stored, StoredTensor) or stored.shape != info.sizes or stored.dtype != dtype:
                raise CorruptShard(f"{key!r}: item at {location.offset} is not the {info.sizes} {dtype} chunk the "
                                   "metadata describes", file_url)
            self._chunks[location] = stored
        return stored

    def read_object(self, location: ItemLocation) -> bytes:
        reader = self._readers.get(location.file)
        if reader is None:
            file_url = storage.join(self.url, location.file)
            reader = self._readers[location.file] = storage.RangeReader(file_url, self._sizes.get(location.file))
        return reader.read(location.offset, location.length)

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

    def read_box(self, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """Elements ``[starts, starts + sizes)`` of this box (coordinates relative to it)."""
        g_starts = tuple(self.lead) + tuple(starts)
        g_sizes = (1,) * len(self.lead) + tuple(sizes)
        out = None
        covered = 0
        for chunk in self.info.chunks:
            lo = [max(a, c) for a, c in zip(g_starts, chunk.offsets)]
            hi = [min(a + n, c + s) for a, n, c, s in zip(g_starts, g_sizes, chunk.offsets, chunk.sizes)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            stored = self.files.chunk(chunk.location, self.key, chunk, self.dtype)
            local_lo = [l - c for l, c in zip(lo, chunk.offsets)]
            counts = [h - l for l, h in zip(lo, hi)]
            region = _read_region(stored, local_lo, counts)
            covered += math.prod(counts)
            if out is None and tuple(counts) == g_sizes:
                out = region  # the box lies in one saved chunk: no second buffer
                break
            if out is None:
                out = torch.empty(g_sizes, dtype=self.dtype)
            out[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, g_starts))] = region
            del region
        if out is None:
            out = torch.empty(g_sizes, dtype=self.dtype)
        if covered != math.prod(g_sizes):
            raise CorruptShard(f"{self.key!r}: the saved chunks cover {covered} of {math.prod(g_sizes)} elements "
                               f"of the box at {g_starts}", self.files.url)
        return out.reshape(tuple(sizes))

    def read(self) -> torch.Tensor:
        return self.read_box((0,) * len(self.shape), self.shape)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Row-major flat pieces: runs of whole rows of dim 0 (one row when a row is larger)."""
        shape = self.shape
        if not shape:
            yield self.read().reshape(-1)
            return
        row_bytes = math.prod(shape[1:]) * self.dtype.itemsize
        rows = max(1, max_bytes // max(row_bytes, 1))
        for start in range(0, shape[0], rows):
            count = min(rows, shape[0] - start)
            yield self.read_box((start,) + (0,) * (len(shape) - 1), (count, *shape[1:])).reshape(-1)


def _read_region(stored: StoredTensor, lo: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """The sub-box ``[lo, lo + counts)`` of a saved chunk, read as a few contiguous runs.

    Dims after ``k`` are taken whole, so each index over the dims before ``k`` is one run of
    ``counts[k]`` rows of dim ``k`` (one run in all when only leading indices are fixed).
    """
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


class DcpWriter:
    """Write a DCP folder: tensor chunks and bytes entries into one data file, then ``.metadata``.

    `add_chunk(key, global_shape, offsets, tensor)` appends a chunk (its own ``torch.save``
    archive); `add_object(key, data)` a bytes entry; `close()` writes ``.metadata`` last and
    returns the file names written. Memory: one chunk at a time.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._out = storage.open_write(storage.join(url, DATA_FILE))
        self._at = 0
        self._tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
        self._locations: dict[tuple[str, tuple[int, ...] | None], tuple[int, int]] = {}

    def _append(self, data: bytes | memoryview) -> tuple[int, int]:
        offset = self._at
        self._out.write(data)
        self._at += len(data)
        return offset, len(data)

    def add_chunk(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], tensor: torch.Tensor) -> None:
        shape = tuple(int(s) for s in global_shape)
        entry = self._tensors.setdefault(key, (shape, tensor.dtype, []))
        if entry[0] != shape or entry[1] != tensor.dtype:
            raise ValueError(f"{key}: chunks disagree on global shape or dtype")
        buffer = io.BytesIO()
        torch.save(tensor.detach().contiguous().clone(), buffer)
        offsets = tuple(int(o) for o in offsets)
        entry[2].append((offsets, tuple(tensor.shape)))
        self._locations[(key, offsets)] = self._append(buffer.getbuffer())

    def add_object(self, key: str, data: bytes) -> None:
        self._locations[(key, None)] = self._append(data)

    def close(self) -> list[str]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        self._out.close()
        state: dict[str, Any] = {}
        storage_data = {}
        for (key, offsets), (offset, length) in self._locations.items():
            index = MetadataIndex(key, torch.Size(offsets) if offsets is not None else None)
            storage_data[index] = _StorageInfo(DATA_FILE, offset, length)
            if offsets is None:
                state[key] = BytesStorageMetadata()
        for key, (shape, dtype, chunks) in self._tensors.items():
            state[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])
        metadata = Metadata(state_dict_metadata=state, storage_data=storage_data)
        storage.write_bytes(storage.join(self.url, METADATA_FILE), pickle.dumps(metadata))
        return [DATA_FILE, METADATA_FILE]

    def abort(self) -> None:
        abort = getattr(self._out, "abort", None)
        if abort is not None:
            abort()
