"""The lazy view every layout gives of a checkpoint: full tensors by name, bytes on demand.

`TensorSource` is the contract between layouts (which know a format's files) and the planner and
writer (which know nothing of formats). Names, shapes and dtypes are known without reading any
weight; `iter_chunks` streams a full (unsharded) tensor in row-major order in pieces of bounded
size, so a tensor of any size is written with bounded memory.

`ConcatTensor` and `ReplicatedTensor` are the two assemblies every sharded format reduces to: a
tensor cut along one dimension into stored pieces, or a tensor stored whole on several ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from merge_engine.errors import CorruptShard
from merge_engine.formats.dtype_names import DTypeByName, describe, name_of
from merge_engine.formats.stored_tensor import StoredTensor

if TYPE_CHECKING:  # torch is imported by the reads; building an assembly (a check) needs none
    import torch

# A chunk: under glibc's mmap threshold, so its buffers are reused, not re-faulted. 4 MiB, not 16: a shard job
# holds ~8 chunks (read ahead, being written, waiting for the hasher) and glibc's heap keeps about twice its
# working set; measured on the 2 GB FSDP benchmark at --workers 1: peak RSS 411-434 MB against
# 610-676 MB at 16 MiB, the same CPU seconds (7.1-8.2 s against 7.6-7.8 s).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
MATERIALISE_BYTES = 64 * 1024 * 1024  # a non-contiguous stored piece up to this is read whole, once


@dataclass(frozen=True)
class AliasGroup:
    """Names whose stored bytes are (in part) the same bytes of one file: ``url``, and ``nbytes`` shared."""

    names: tuple[str, ...]
    url: str
    nbytes: int


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of a full tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class TensorSource(Protocol):
    """A checkpoint's full tensors, read lazily.

    - `metas()` is computed from metadata alone (headers, pickles, listings) and is ordered.
    - `iter_chunks(name, max_bytes)` yields 1-D tensors of the stored dtype, each at most
      ``max_bytes`` (unless a single row of a sharded dimension is larger), whose concatenation
      is ``read(name).reshape(-1)``. Values are exactly those stored: no cast, no copy of the model.
    - Errors: `CorruptShard` / `IncompleteCheckpoint` naming the file at fault.
    - ``verify_reads()`` (optional): check what was read so far against the files' own checksums (zip
      CRC-32), reading what is left of any record begun; a shard job calls it before its output counts.
    """

    url: str

    def metas(self) -> Mapping[str, TensorMeta]: ...

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


def flat_reader(piece: StoredTensor) -> Callable[[int, int], torch.Tensor]:
    """``read(start, count)`` over a stored tensor's row-major flattening. A contiguous tensor is read
    range by range; a small non-contiguous one (a transposed view, storage span up to
    `MATERIALISE_BYTES`) is materialised once, at the first read, instead of once per chunk; a
    larger one is gathered range by range in bounded storage windows (`StoredTensor.read_flat`)."""
    if piece.is_contiguous() or piece.span * piece.itemsize > MATERIALISE_BYTES:
        return piece.read_flat
    flat: list[torch.Tensor] = []

    def read(start: int, count: int) -> torch.Tensor:
        if not flat:
            flat.append(piece.read().reshape(-1))
        return flat[0][start:start + count]

    return read


@dataclass(frozen=True)
class ConcatTensor(DTypeByName):
    """A full tensor = its stored pieces concatenated along ``dim`` (pieces may be empty).

    ``dtype_name`` is canonical (a ``torch.dtype`` or pickled dtype given for it is stored as its name):
    built in a check without torch; ``dtype`` is the ``torch.dtype``."""

    shape: tuple[int, ...]
    dtype_name: str
    dim: int
    pieces: tuple[StoredTensor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", name_of(self.dtype_name))
        where = self.pieces[0].archive.url if self.pieces else None
        total = 0
        for piece in self.pieces:
            if piece.dtype_name != self.dtype_name:
                raise CorruptShard(f"shard dtype {describe(piece.dtype_name)} differs from "
                                   f"{describe(self.dtype_name)}", piece.archive.url)
            if len(piece.shape) != len(self.shape) or any(
                a != b for i, (a, b) in enumerate(zip(piece.shape, self.shape)) if i != self.dim
            ):
                raise CorruptShard(f"shard shape {piece.shape} does not fit {self.shape} cut on dim {self.dim}",
                                   piece.archive.url)
            total += piece.shape[self.dim] if piece.shape else 1
        if self.shape and total != self.shape[self.dim]:
            raise CorruptShard(f"shards cover {total} of {self.shape[self.dim]} along dim {self.dim}", where)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        import torch

        max_elems = max(1, max_bytes // self.itemsize)
        if self.dim == 0 or len(self.pieces) == 1:
            for piece in self.pieces:
                n = piece.numel
                read = flat_reader(piece)
                for start in range(0, n, max_elems):
                    yield read(start, min(max_elems, n - start))
            return
        outer = math.prod(self.shape[: self.dim])
        inners = [math.prod(p.shape[self.dim:]) for p in self.pieces]
        row = sum(inners)
        rows_per_chunk = max(1, max_elems // max(row, 1))
        readers = [flat_reader(p) for p in self.pieces]
        for a in range(0, outer, rows_per_chunk):
            b = min(outer, a + rows_per_chunk)
            block = torch.empty((b - a, row), dtype=self.dtype)
            col = 0
            for read, inner in zip(readers, inners):
                if inner:
                    part = read(a * inner, (b - a) * inner).view(b - a, inner)
                    block[:, col:col + inner] = part
                col += inner
            yield block.reshape(-1)

    def iter_range(self, start: int, count: int, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Elements ``[start, start+count)`` of the row-major flattening, in flat chunks of at most
        ``max_bytes``. Cut on dim 0 (or one piece), a range is a byte range of the pieces it crosses;
        cut on a later dim, each row of the range is gathered from its piece segments."""
        import torch

        if count <= 0:
            return
        max_elems = max(1, max_bytes // self.itemsize)
        if self.dim == 0 or len(self.pieces) == 1:
            at = 0
            for piece in self.pieces:
                n = piece.numel
                lo, hi = max(start, at), min(start + count, at + n)
                if lo < hi:
                    read = flat_reader(piece)
                    for a in range(lo, hi, max_elems):
                        yield read(a - at, min(max_elems, hi - a))
                at += n
            return
        inners = [math.prod(p.shape[self.dim:]) for p in self.pieces]
        row = sum(inners)
        readers = [flat_reader(p) for p in self.pieces]
        buffer: list[torch.Tensor] = []
        held = 0
        position, end = start, start + count
        while position < end:
            r, c0 = divmod(position, row)
            c1 = min(row, c0 + end - position)
            col = 0
            for read, inner in zip(readers, inners):
                lo, hi = max(c0, col), min(c1, col + inner)
                if lo < hi:
                    buffer.append(read(r * inner + lo - col, hi - lo))
                    held += hi - lo
                col += inner
            position += c1 - c0
            if held >= max_elems or position >= end:
                yield torch.cat(buffer) if len(buffer) > 1 else buffer[0]
                buffer, held = [], 0

    def read(self) -> torch.Tensor:
        import torch

        if not self.pieces:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.cat([p.read() for p in self.pieces], dim=self.dim) if len(self.pieces) > 1 else \
            self.pieces[0].read()


@dataclass(frozen=True)
class ReplicatedTensor:
    """A full tensor stored whole on several ranks; the copies are checked to be identical."""

    copies: tuple[StoredTensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.copies[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.copies[0].dtype

    @property
    def dtype_name(self) -> str:
        return self.copies[0].dtype_name

    @property
    def itemsize(self) -> int:
        return self.copies[0].itemsize

    def __post_init__(self) -> None:
        first = self.copies[0]
        for other in self.copies[1:]:
            if other.shape != first.shape or other.dtype_name != first.dtype_name:
                raise CorruptShard(f"replicated tensor is {other.shape} {describe(other.dtype_name)} here but "
                                   f"{first.shape} {describe(first.dtype_name)} on another rank", other.archive.url)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        import torch

        max_elems = max(1, max_bytes // self.itemsize)
        first = self.copies[0]
        n = first.numel
        readers = [flat_reader(copy) for copy in self.copies]
        for start in range(0, n, max_elems):
            count = min(max_elems, n - start)
            chunk = readers[0](start, count)
            for other, read in zip(self.copies[1:], readers[1:]):
                if not torch.equal(read(start, count), chunk):
                    raise CorruptShard("replicated tensor differs between ranks (expected identical copies)",
                                       other.archive.url)
            yield chunk

    def iter_range(self, start: int, count: int, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Elements ``[start, start+count)`` of the flattening; every copy's range is checked equal."""
        import torch

        max_elems = max(1, max_bytes // self.itemsize)
        readers = [flat_reader(copy) for copy in self.copies]
        for a in range(start, start + count, max_elems):
            n = min(max_elems, start + count - a)
            chunk = readers[0](a, n)
            for other, read in zip(self.copies[1:], readers[1:]):
                if not torch.equal(read(a, n), chunk):
                    raise CorruptShard("replicated tensor differs between ranks (expected identical copies)",
                                       other.archive.url)
            yield chunk

    def read(self) -> torch.Tensor:
        import torch

        return torch.cat(list(self.iter_chunks())).reshape(self.shape) if self.copies[0].numel else \
            torch.empty(self.shape, dtype=self.dtype)


@dataclass(frozen=True)
class StackedTensor(DTypeByName):
    """A full tensor = bands stacked along dim 0, each band an assembly of its own (a 2-D tiling:
    FSDP rows x tensor-parallel columns). Streams band by band: memory is one band's chunk."""

    shape: tuple[int, ...]
    dtype_name: str
    bands: tuple[ConcatTensor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", name_of(self.dtype_name))
        rows = 0
        for band in self.bands:
            if band.dtype_name != self.dtype_name or tuple(band.shape[1:]) != tuple(self.shape[1:]):
                where = band.pieces[0].archive.url if band.pieces else None
                raise CorruptShard(f"band {band.shape} {describe(band.dtype_name)} does not fit {self.shape} "
                                   f"{describe(self.dtype_name)}", where)
            rows += band.shape[0]
        if rows != self.shape[0]:
            raise CorruptShard(f"bands cover {rows} of {self.shape[0]} rows", None)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        for band in self.bands:
            yield from band.iter_chunks(max_bytes)

    def iter_range(self, start: int, count: int, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        at = 0
        for band in self.bands:
            n = math.prod(band.shape)
            lo, hi = max(start, at), min(start + count, at + n)
            if lo < hi:
                yield from band.iter_range(lo - at, hi - lo, max_bytes)
            at += n

    def read(self) -> torch.Tensor:
        import torch

        return torch.cat([band.read() for band in self.bands], dim=0)


@dataclass(frozen=True)
class FlatTensor(DTypeByName):
    """A full tensor whose row-major flattening is its 1-D stored pieces concatenated, cut anywhere (a row may
    span two pieces): a parameter rebuilt from flat optimizer partitions (DeepSpeed ZeRO). Streams piece by
    piece; a range is a byte range of the pieces it crosses."""

    shape: tuple[int, ...]
    dtype_name: str
    pieces: tuple[StoredTensor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", name_of(self.dtype_name))
        where = self.pieces[0].archive.url if self.pieces else None
        for piece in self.pieces:
            if piece.dtype_name != self.dtype_name or len(piece.shape) != 1:
                raise CorruptShard(f"flat piece {piece.shape} {describe(piece.dtype_name)} does not fit a "
                                   f"{describe(self.dtype_name)} tensor", piece.archive.url)
        total = sum(piece.numel for piece in self.pieces)
        if total != math.prod(self.shape):
            raise CorruptShard(f"flat pieces hold {total} of the {math.prod(self.shape)} elements of {self.shape}",
                               where)

    def _flat(self) -> ConcatTensor:
        return ConcatTensor((math.prod(self.shape),), self.dtype_name, 0, self.pieces)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        return self._flat().iter_chunks(max_bytes)

    def iter_range(self, start: int, count: int, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        return self._flat().iter_range(start, count, max_bytes)

    def read(self) -> torch.Tensor:
        return self._flat().read().reshape(self.shape)


class Assembly(Protocol):
    """A tensor assembled lazily from stored pieces (`ConcatTensor`, `ReplicatedTensor`, `StackedTensor`,
    `FlatTensor`, a layout's own): its shape and dtype, read whole or as flat chunks. One that can start
    inside also has ``iter_range(start, count, max_bytes)``."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]: ...
    def read(self) -> torch.Tensor: ...


def _pieces(tensor: object) -> tuple[StoredTensor, ...]:
    """The stored pieces of a torch-archive assembly; () for any other (a DCP tensor: its reader already
    refuses two items sharing bytes of a data file)."""
    if isinstance(tensor, StackedTensor):
        return tuple(piece for band in tensor.bands for piece in band.pieces)
    if isinstance(tensor, (ConcatTensor, FlatTensor)):
        return tensor.pieces
    if isinstance(tensor, ReplicatedTensor):
        return tensor.copies
    return ()


class _Closable(Protocol):
    def close(self) -> None: ...


class AssembledSource:
    """A `TensorSource` over a name -> assembly table (what sharded layouts build)."""

    def __init__(self, url: str, tensors: Mapping[str, Assembly], archives: Sequence[_Closable] = ()) -> None:
        self.url = url
        self._tensors = dict(tensors)
        self._metas = {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items()}
        self._archives = archives
        self.parallel: dict[str, int] = {}  # the parallel sizes it was saved with, where a layout records them

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def assembly(self, name: str) -> Assembly:
        """The assembly ``name`` is read through (a source built on this one reads through it too)."""
        return self._tensors[name]

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        return self._tensors[name].iter_chunks(max_bytes)

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name].read()

    def iter_range(self, name: str, start: int, count: int,
                   max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Elements ``[start, start+count)`` of ``name``'s flattening: a ranged read where its assembly has
        one (`can_read_range`), else its chunk stream with the elements outside the range skipped."""
        tensor = self._tensors[name]
        if hasattr(tensor, "iter_range"):
            return tensor.iter_range(start, count, max_bytes)
        return _skipping(tensor.iter_chunks(max_bytes), start, count)

    def can_read_range(self, name: str) -> bool:
        """Whether `iter_range` reads only the range asked for (its assembly has a ranged read)."""
        return hasattr(self._tensors[name], "iter_range")

    def same_storage(self, a: str, b: str) -> bool:
        """True when two names are views of the very same stored bytes (tied weights saved once)."""
        ta, tb = self._tensors[a], self._tensors[b]
        if isinstance(ta, StackedTensor) or isinstance(tb, StackedTensor):
            return False
        parts_a, parts_b = _pieces(ta), _pieces(tb)
        return len(parts_a) == len(parts_b) and all(
            x.archive is y.archive and x.storage == y.storage and x.offset == y.offset and x.shape == y.shape
            and x.stride == y.stride for x, y in zip(parts_a, parts_b))

    def alias_groups(self) -> list[AliasGroup]:
        """Groups of names whose stored pieces are the same bytes of one file (a storage pickled once and
        named several times), with that file and the bytes shared; metadata only. Two distinct views
        of one record never overlap in part (`TorchArchive` refuses that), so sharing is identity.
        `merge_engine.plan.stored_aliases` decides which groups a config allows."""
        owner: dict[tuple, str] = {}
        groups: dict[str, list[str]] = {}
        where: dict[str, tuple[str, int]] = {}
        for name, tensor in self._tensors.items():
            for piece in _pieces(tensor):
                if not piece.numel:
                    continue
                size = piece.itemsize
                span = piece.span
                key = (piece.archive.url, piece.storage.key, piece.offset * size, span * size,
                       None if span == piece.numel else (piece.shape, piece.stride))
                first = owner.setdefault(key, name)
                if first != name:
                    root = next((r for r, members in groups.items() if first in members), first)
                    members = groups.setdefault(root, [root])
                    if name not in members:
                        members.append(name)
                    where.setdefault(root, (piece.archive.url, span * size))
        return [AliasGroup(tuple(members), *where[root]) for root, members in groups.items()]

    def verify_reads(self) -> None:
        """Check every zip record read from so far against its CRC-32 (`TorchArchive.verify_reads`)."""
        for archive in self._archives:
            verify = getattr(archive, "verify_reads", None)
            if verify is not None:
                verify()

    def close(self) -> None:
        for archive in self._archives:
            archive.close()


def _skipping(chunks: Iterator[torch.Tensor], start: int, count: int) -> Iterator[torch.Tensor]:
    """The elements ``[start, start+count)`` of a flat chunk stream (those outside are read, not kept)."""
    at, end = 0, start + count
    for chunk in chunks:
        n = chunk.numel()
        lo, hi = max(start, at), min(end, at + n)
        if lo < hi:
            yield chunk[lo - at:hi - at]
        at += n
        if at >= end:
            return


def iter_flat_range(source: TensorSource, name: str, start: int, count: int,
                    max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """Elements ``[start, start+count)`` of ``name``'s row-major flattening, in flat chunks of at most
    ``max_bytes``: a ranged read where the source offers one (``iter_range``), else the tensor's chunk
    stream with the elements outside the range skipped (read, not kept)."""
    ranged = getattr(source, "iter_range", None)
    if ranged is not None:
        yield from ranged(name, start, count, max_bytes)
        return
    yield from _skipping(source.iter_chunks(name, max_bytes), start, count)
