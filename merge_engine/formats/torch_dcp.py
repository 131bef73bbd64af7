"""torch.distributed.checkpoint (DCP) folders read without a process group or a GPU.

A DCP folder holds ``.metadata`` (its index: `merge_engine.formats.dcp_index`) and data files
``__<rank>_<n>.distcp`` that are plain concatenations of items. A tensor chunk's item is a
complete ``torch.save`` archive of that chunk; a bytes entry's item is its raw bytes.

- a chunk's archive is opened on first use, over a window of its data file (ranged reads only: `DcpFiles`);
- `DcpTensor` is a box of a global tensor (some leading indices fixed, e.g. one layer of a
  stacked ``[layers, ...]`` tensor): it reads exactly the chunk regions that intersect it.
Writing is `merge_engine.formats.torch_dcp_writer`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.formats.dcp_index import ChunkInfo, ItemLocation, TensorInfo, tiling_problem
from merge_engine.formats.dtype_names import ITEMSIZES, describe
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES
from merge_engine.formats.stored_tensor import StoredTensor
from merge_engine.formats.torch_archive import TorchArchive

if TYPE_CHECKING:  # the chunk reads import torch, never a check
    import torch


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
            window = _Window(reader, location.offset, location.length)
            # a window serves the reads an archive makes (size, read, read_into, close); it is never carried
            archive = TorchArchive(f"{file_url}@{location.offset}", window)  # type: ignore[arg-type]
            stored = archive.load()
            if not isinstance(stored, StoredTensor) or stored.shape != info.sizes or stored.dtype_name != dtype:
                raise CorruptShard(f"{key!r}: item at {location.offset} is not the {info.sizes} {describe(dtype)} chunk the "
                                   "metadata describes", file_url)
            self._chunks[location] = stored
        return stored

    def _open(self, file_url: str, name: str) -> storage.RangeReader:
        size, version = self._sizes.get(name), self._versions.get(name)
        return storage.RangeReader(file_url, size, version if size is not None else None)

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
