"""A checked checkpoint's parsed tensor index, carried in `Checkpoint.index` so that nothing is parsed twice.

A layout's deep check reads every rank file's header (the zip directory and the pickle of a
``torch.save`` file) and builds from them the table `open` serves: canonical name -> lazy tensor
(`merge_engine.formats.tensor_source.Assembly`, pieces pointing into their files). `carry` writes that
table and its files as plain data: JSON of lists, strings and integers under a version tag, compressed
(zlib). `restore` rebuilds the engine's records from it with their own constructors, in this process or in
any other the checkpoint travels to (a Ray worker), and reads nothing: a rebuilt file
handle holds its zip directory and opens its reader pinned to the size and version the check listed
(`merge_engine.storage.RangeReader.listed`), so a file changed since the check gives `SourceChanged`
naming it at its first read, never bytes of another version.

The index is never a pickle: no name read from it is imported, looked up or called. It is never kept in
Prefect's result store (a forged one could give a name another tensor's bytes); still,
`restore` trusts nothing in its bytes. It refuses with `UnsafeRecord`
(naming the checkpoint) an index that
- inflates past `MAX_INDEX_BYTES`, nests past the JSON bound or holds more than `MAX_ITEMS` tensors, files
  or storages, or a tensor of more than `MAX_DIMS` dimensions;
- names a file that is not one of the checkpoint's listed files (`Checkpoint.files`, joined to its URL) with
  the listed size and version: an index cannot send a read to a host file, another bucket or another step;
- holds a field of the wrong kind (a string for an integer, a bool, a negative size), a dtype torch does not
  have, a storage that is not one zip record of its file holding exactly its bytes inside the file, a view
  outside its storage (`view_problem`), or pieces that do not tile their tensor.
An index of another engine version or format (the tag) is not read: `restore` gives None and the caller
reads the headers again. Bounded: an index over `MAX_INDEX_BYTES` is not carried (`carry` gives None).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from merge_engine.errors import CorruptShard, UnsafeRecord
from merge_engine.storage.json_text import parse_json

if TYPE_CHECKING:
    from merge_engine.layouts.contract import Checkpoint

# the records' shape: bump it whenever what an index holds changes (an index of another shape, from Prefect's
# result storage of an older engine, is then not read: `restore` gives None)
INDEX_FORMAT = 4
MAX_INDEX_BYTES = 64 << 20  # the JSON, before compression: ~200k tensor pieces (hundreds of rank files)
MAX_ITEMS = 1 << 22  # tensors, files, storages, pieces of one tensor: each list of an index at most this long
MAX_DIMS = 64  # dimensions of one tensor
MAX_INT = (1 << 63) - 1  # offsets, sizes, element counts: what a file can address


def _tag() -> bytes:
    from merge_engine import __version__

    return f"stepmerge {__version__} tensor index {INDEX_FORMAT}\n".encode()


def carry(tensors: Mapping[str, Any], handles: Sequence[Any]) -> bytes | None:
    """The index of ``tensors`` (name -> lazy tensor) over the torch archives ``handles`` they point into, as
    tagged compressed JSON; None when its JSON is over `MAX_INDEX_BYTES`, or it holds a record this
    format does not describe (then `open` reads the headers again)."""
    try:
        document = _Writer(handles).document(tensors)
    except _NotCarried:
        return None
    data = json.dumps(document, separators=(",", ":")).encode()
    return _tag() + zlib.compress(data) if len(data) <= MAX_INDEX_BYTES else None


def _carried_json(checkpoint: Checkpoint, tag: bytes, what: str) -> bytes | None:
    """The JSON text ``checkpoint.index`` carries under ``tag`` (None: no index, or another engine version's
    or format's); `UnsafeRecord` for one that does not inflate within `MAX_INDEX_BYTES`."""
    index = checkpoint.index
    if index is None or not index.startswith(tag):
        return None
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(index[len(tag):], MAX_INDEX_BYTES)
    except zlib.error as exc:
        raise UnsafeRecord(f"carried {what} does not inflate ({exc})", checkpoint.url) from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise UnsafeRecord(f"carried {what} inflates past {MAX_INDEX_BYTES} bytes, or is cut short", checkpoint.url)
    return data


def restore(checkpoint: Checkpoint) -> tuple[dict[str, Any], list[Any]] | None:
    """A fresh copy of ``checkpoint``'s carried index: (name -> lazy tensor, the file handles they read
    through); None for no index, or one another engine version or format carried (the caller reads the
    headers again). `UnsafeRecord` naming the checkpoint for an index that is not what `carry` writes for
    this checkpoint (module docstring)."""
    data = _carried_json(checkpoint, _tag(), "tensor index")
    if data is None:
        return None
    document = parse_json(data, checkpoint.url, error=UnsafeRecord)
    try:
        return _Reader(checkpoint).read(document)
    except UnsafeRecord:
        raise
    except CorruptShard as exc:  # a record's own constructor refused the values (pieces that do not tile...)
        raise UnsafeRecord(f"carried tensor index: {exc.message}", checkpoint.url) from None


class _NotCarried(Exception):
    """The table holds a record the index format does not describe."""


class _Writer:
    def __init__(self, handles: Sequence[Any]) -> None:
        from merge_engine.formats.torch_archive import TorchArchive

        if not all(isinstance(h, TorchArchive) for h in handles):
            raise _NotCarried
        self.handles = list(handles)
        self.files = {id(h): i for i, h in enumerate(self.handles)}
        self.storages: dict[tuple[int, str, str, int], int] = {}

    def document(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        table = [[name, *self.tensor(t)] for name, t in tensors.items()]
        return {"format": INDEX_FORMAT, "files": [h.carried() for h in self.handles],
                "storages": [list(key) for key in self.storages], "tensors": table}

    def tensor(self, tensor: Any) -> list[Any]:
        from merge_engine.formats.tensor_source import ConcatTensor, FlatTensor, ReplicatedTensor, StackedTensor

        if isinstance(tensor, FlatTensor):
            return ["flat", list(tensor.shape), tensor.dtype_name, [self.piece(p) for p in tensor.pieces]]
        if isinstance(tensor, ConcatTensor):
            return ["concat", *self.concat(tensor)]
        if isinstance(tensor, ReplicatedTensor):
            return ["replicated", [self.piece(p) for p in tensor.copies]]
        if isinstance(tensor, StackedTensor):
            return ["stacked", list(tensor.shape), tensor.dtype_name, [self.concat(b) for b in tensor.bands]]
        raise _NotCarried

    def concat(self, tensor: Any) -> list[Any]:
        return [list(tensor.shape), tensor.dtype_name, tensor.dim, [self.piece(p) for p in tensor.pieces]]

    def piece(self, piece: Any) -> list[Any]:
        file = self.files.get(id(piece.archive))
        if file is None:
            raise _NotCarried
        ref = piece.storage
        key = (file, ref.key, ref.dtype_name, ref.numel)
        storage = self.storages.setdefault(key, len(self.storages))
        return [storage, piece.offset, list(piece.shape), list(piece.stride)]


class _Reader:
    """Rebuilds an index document with the engine's constructors, every value checked first."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        from merge_engine import storage

        self.url = checkpoint.url
        self.listed = {storage.join(checkpoint.url, f.path): f for f in checkpoint.files}

    def fail(self, message: str) -> UnsafeRecord:
        return UnsafeRecord(f"carried tensor index: {message}", self.url)

    def read(self, document: Any) -> tuple[dict[str, Any], list[Any]]:
        if not isinstance(document, dict) or set(document) != {"format", "files", "storages", "tensors"} \
                or document["format"] != INDEX_FORMAT:
            raise self.fail("not an index document of this format")
        self.handles = [self.file(f) for f in self.items(document["files"], "files")]
        self.storages = [self.storage(s) for s in self.items(document["storages"], "storages")]
        tensors: dict[str, Any] = {}
        for entry in self.items(document["tensors"], "tensors"):
            if not isinstance(entry, list) or len(entry) < 2 or not isinstance(entry[0], str):
                raise self.fail("a tensor entry is not [name, kind, ...]")
            if entry[0] in tensors:
                raise self.fail(f"tensor {entry[0]!r} listed twice")
            tensors[entry[0]] = self.tensor(entry[1:])
        return tensors, self.handles

    # --- plain values ---------------------------------------------------------------------------------
    def items(self, value: Any, what: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list) or len(value) > MAX_ITEMS or (length is not None and len(value) != length):
            raise self.fail(f"{what} is not a list of the expected length")
        return value

    def integer(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value <= MAX_INT:
            raise self.fail(f"{what} is {value!r}, not a non-negative integer")
        return value

    def string(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or len(value) > 4096:
            raise self.fail(f"{what} is not a string")
        return value

    def dims(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > MAX_DIMS:
            raise self.fail(f"{what} is not a list of at most {MAX_DIMS} sizes")
        return tuple(self.integer(v, what) for v in value)

    def dtype(self, value: Any) -> str:
        from merge_engine.formats.dtype_names import ITEMSIZES

        if not isinstance(value, str) or value not in ITEMSIZES:
            raise self.fail(f"dtype {value!r} is not a canonical torch dtype name")
        return value

    # --- records ------------------------------------------------------------------------------------
    def file(self, value: Any) -> Any:
        from merge_engine.formats.torch_archive import StorageRecordInfo, TorchArchive

        fields = {"url", "size", "version", "prefix", "records", "starts"}
        if not isinstance(value, dict) or set(value) != fields:
            raise self.fail("a file entry is not {url, size, version, prefix, records, starts}")
        url = self.string(value["url"], "a file's URL")
        entry = self.listed.get(url)
        if entry is None:
            raise self.fail(f"names the file {url!r}, which is not one of the checkpoint's listed files")
        size = self.integer(value["size"], "a file's size")
        version = value["version"]
        if version is not None and not isinstance(version, str) or size != entry.size \
                or (version or None) != (entry.version or None):
            raise self.fail(f"pins {url} to size {size} version {version!r}; the listing says {entry.size} "
                            f"{entry.version!r}")
        prefix = self.string(value["prefix"], "an archive prefix")
        starts = [self.integer(s, "a record start") for s in self.items(value["starts"], "record starts")]
        if starts != sorted(set(starts)) or any(s > size for s in starts):
            raise self.fail(f"record starts of {url} are not increasing offsets inside the file")
        records = []
        for record in self.items(value["records"], "storage records"):
            name, offset, length, crc = self.items(record, "a storage record", 4)
            name = self.string(name, "a storage record's name")
            if not name.startswith(f"{prefix}data/"):
                raise self.fail(f"storage record {name!r} of {url} lies outside {prefix}data/")
            info = StorageRecordInfo(name, self.integer(offset, "a record offset"), self.integer(length, "a record size"),
                                     self.integer(crc, "a record CRC"))
            if info.header_offset not in starts or info.header_offset + info.file_size > size or info.CRC >> 32:
                raise self.fail(f"storage record {name!r} of {url} is not a zip record inside the file")
            records.append(info)
        return TorchArchive.from_carried(url, size, entry.version, prefix, records, starts)

    def storage(self, value: Any) -> Any:
        from merge_engine.formats.stored_tensor import StorageRef

        file, key, dtype, numel = self.items(value, "a storage", 4)
        file = self.integer(file, "a storage's file")
        if file >= len(self.handles):
            raise self.fail(f"a storage names file {file} of {len(self.handles)}")
        archive = self.handles[file]
        ref = StorageRef(self.string(key, "a storage key"), self.dtype(dtype), self.integer(numel, "an element count"))
        archive.check_record(ref)  # one zip record of the file holding exactly these bytes (no read)
        return archive, ref

    def piece(self, value: Any) -> Any:
        from merge_engine.formats.stored_tensor import StoredTensor, view_problem

        storage, offset, shape, stride = self.items(value, "a piece", 4)
        storage = self.integer(storage, "a piece's storage")
        if storage >= len(self.storages):
            raise self.fail(f"a piece names storage {storage} of {len(self.storages)}")
        archive, ref = self.storages[storage]
        offset, shape, stride = self.integer(offset, "an offset"), self.dims(shape, "a shape"), self.dims(stride, "strides")
        problem = view_problem(ref.numel, offset, shape, stride)
        if problem:
            raise self.fail(f"a piece of storage {ref.key} of {archive.url}: {problem}")
        return StoredTensor(archive, ref, offset, shape, stride)

    def concat(self, value: Any) -> Any:
        from merge_engine.formats.tensor_source import ConcatTensor

        shape, dtype, dim, pieces = self.items(value, "a concatenation", 4)
        shape = self.dims(shape, "a shape")
        dim = self.integer(dim, "a dimension")
        if shape and dim >= len(shape):
            raise self.fail(f"cut on dimension {dim} of a {len(shape)}-d tensor")
        return ConcatTensor(shape, self.dtype(dtype), dim, tuple(self.piece(p) for p in self.items(pieces, "pieces")))

    def tensor(self, value: list[Any]) -> Any:
        from merge_engine.formats.tensor_source import FlatTensor, ReplicatedTensor, StackedTensor

        kind, rest = value[0], value[1:]
        if kind == "concat":
            return self.concat(rest)
        if kind == "replicated":
            (copies,) = self.items(rest, "a replicated tensor", 1)
            copies = tuple(self.piece(p) for p in self.items(copies, "copies"))
            if not copies:
                raise self.fail("a replicated tensor without copies")
            return ReplicatedTensor(copies)
        if kind == "stacked":
            shape, dtype, bands = self.items(rest, "a stacked tensor", 3)
            shape = self.dims(shape, "a shape")
            if not shape:
                raise self.fail("a stacked tensor of no dimension")
            return StackedTensor(shape, self.dtype(dtype), tuple(self.concat(b) for b in self.items(bands, "bands")))
        if kind == "flat":
            shape, dtype, pieces = self.items(rest, "a flat tensor", 3)
            return FlatTensor(self.dims(shape, "a shape"), self.dtype(dtype),
                              tuple(self.piece(p) for p in self.items(pieces, "pieces")))
        raise self.fail(f"tensor kind {kind!r} is not concat, replicated, stacked or flat")


# --------------------------------------------------------------------------------------------------
# A DCP ``.metadata`` index (`merge_engine.formats.dcp_index.DcpIndex`), carried the same way: plain JSON of
# keys, shapes, dtype names and item locations, rebuilt by the records' own constructors and checked as
# `merge_engine.formats.dcp_index.read_index` checks the file (every chunk inside its tensor, the chunks
# tiling it, each item long enough and no two sharing bytes), each data file one the checkpoint lists
# in the index's folder, holding the bytes its items name.

DCP_INDEX_FORMAT = 1


def _dcp_tag() -> bytes:
    from merge_engine import __version__

    return f"stepmerge {__version__} dcp index {DCP_INDEX_FORMAT}\n".encode()


def carry_dcp(index: Any) -> bytes | None:
    """``index`` (a `DcpIndex`) as tagged compressed JSON; None when its JSON is over `MAX_INDEX_BYTES`."""
    def where(loc: Any) -> list[Any]:
        return [loc.file, loc.offset, loc.length]

    document = {"format": DCP_INDEX_FORMAT,
                "tensors": [[key, list(info.shape), info.dtype_name,
                             [[list(c.offsets), list(c.sizes), *where(c.location)] for c in info.chunks]]
                            for key, info in index.tensors.items()],
                "objects": [[key, *where(loc)] for key, loc in index.objects.items()]}
    data = json.dumps(document, separators=(",", ":")).encode()
    return _dcp_tag() + zlib.compress(data) if len(data) <= MAX_INDEX_BYTES else None


def restore_dcp(checkpoint: Checkpoint, folder: str) -> Any | None:
    """The `DcpIndex` of the DCP folder ``folder`` (relative to the checkpoint, ``""`` or ending in ``/``)
    that ``checkpoint.index`` carries; None for no index or one of another engine version or format (the
    caller reads ``.metadata``). `UnsafeRecord` naming the checkpoint for anything `carry_dcp` does not write
    for this checkpoint."""
    from merge_engine import storage

    data = _carried_json(checkpoint, _dcp_tag(), "DCP index")
    if data is None:
        return None
    document = parse_json(data, checkpoint.url, error=UnsafeRecord)
    sizes = {f.path[len(folder):]: f.size for f in checkpoint.files
             if f.path.startswith(folder) and "/" not in f.path[len(folder):]}
    folder_url = storage.join(checkpoint.url, folder.rstrip("/")) if folder else checkpoint.url
    return _DcpReader(checkpoint.url, sizes).read(document, folder_url)


class _PlainReader(_Reader):
    """`_Reader`'s checks of plain values, for a document that holds no torch archive."""

    def __init__(self, url: str, what: str) -> None:  # noqa: D107 - no listing of archives here
        self.url = url
        self.what = what

    def fail(self, message: str) -> UnsafeRecord:
        return UnsafeRecord(f"{self.what}: {message}", self.url)


class _DcpReader(_PlainReader):
    def __init__(self, url: str, sizes: Mapping[str, int]) -> None:
        super().__init__(url, "carried DCP index")
        self.sizes = sizes

    def location(self, file: Any, offset: Any, length: Any) -> Any:
        from merge_engine.formats.dcp_index import ItemLocation

        file = self.string(file, "a data file")
        offset, length = self.integer(offset, "an item offset"), self.integer(length, "an item length")
        size = self.sizes.get(file)
        if size is None or "/" in file or file.startswith("."):
            raise self.fail(f"names the data file {file!r}, which is not one the checkpoint lists beside its index")
        if offset + length > size:
            raise self.fail(f"an item at {offset}+{length} of {file} lies past its {size} bytes")
        return ItemLocation(file, offset, length)

    def read(self, document: Any, folder_url: str) -> Any:  # type: ignore[override]
        import math

        from merge_engine.formats.dtype_names import ITEMSIZES
        from merge_engine.formats.dcp_index import ChunkInfo, DcpIndex, TensorInfo, tiling_problem

        if not isinstance(document, dict) or set(document) != {"format", "tensors", "objects"} \
                or document["format"] != DCP_INDEX_FORMAT:
            raise self.fail("not a DCP index document of this format")
        tensors, objects, items = {}, {}, []
        for entry in self.items(document["tensors"], "tensors"):
            key, shape, dtype, chunks = self.items(entry, "a tensor", 4)
            key, shape, dtype = self.string(key, "a key"), self.dims(shape, "a shape"), self.dtype(dtype)
            if key in tensors:
                raise self.fail(f"tensor {key!r} listed twice")
            infos = []
            for chunk in self.items(chunks, "chunks"):
                raw_offsets, raw_sizes, *where = self.items(chunk, "a chunk", 5)
                offsets, sizes = self.dims(raw_offsets, "chunk offsets"), self.dims(raw_sizes, "chunk sizes")
                location = self.location(*where)
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                        o + s > d for o, s, d in zip(offsets, sizes, shape)):
                    raise self.fail(f"{key!r}: chunk {offsets}+{sizes} lies outside {shape}")
                if location.length < math.prod(sizes) * ITEMSIZES[dtype]:
                    raise self.fail(f"{key!r}: chunk {sizes} needs more bytes than its item's {location.length}")
                infos.append(ChunkInfo(offsets, sizes, location))
                items.append(location)
            problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in infos])
            if problem:
                raise self.fail(f"{key!r} {shape}: its {problem}")
            tensors[key] = TensorInfo(shape, dtype, tuple(infos))
        for entry in self.items(document["objects"], "objects"):
            key, *where = self.items(entry, "an object", 4)
            key = self.string(key, "a key")
            if key in objects:
                raise self.fail(f"object {key!r} listed twice")
            objects[key] = self.location(*where)
            items.append(objects[key])
        previous = None
        for loc in sorted(items, key=lambda loc: (loc.file, loc.offset)):
            if previous is not None and previous.file == loc.file and previous.offset + previous.length > loc.offset:
                raise self.fail(f"two items share bytes of {loc.file} at {loc.offset}")
            previous = loc
        return DcpIndex(folder_url, tensors, objects)


# --------------------------------------------------------------------------------------------------
# A Hugging Face folder's safetensors headers (`merge_engine.layouts.hf`), carried the same way: each weight file's
# name, the tensor names its index puts there (None: no index) and its header's JSON as stored; `restore_headers`
# checks the document's shape and that each file is one the checkpoint lists in its folder, and the layout checks
# each header again exactly as it checks the file's (`merge_engine.formats.safetensors_file.parse_header`).

HEADERS_FORMAT = 1


def _headers_tag() -> bytes:
    from merge_engine import __version__

    return f"stepmerge {__version__} safetensors headers {HEADERS_FORMAT}\n".encode()


def carry_headers(files: Sequence[tuple[str, Sequence[str] | None, bytes]]) -> bytes | None:
    """(file name, the names its index puts there or None, its header's JSON) of every weight file, as tagged
    compressed JSON; None when over `MAX_INDEX_BYTES`."""
    document = {"format": HEADERS_FORMAT,
                "files": [[name, None if names is None else list(names), header.decode("utf-8")]
                          for name, names, header in files]}
    data = json.dumps(document, separators=(",", ":")).encode()
    return _headers_tag() + zlib.compress(data) if len(data) <= MAX_INDEX_BYTES else None


def restore_headers(checkpoint: Checkpoint) -> list[tuple[str, list[str] | None, bytes]] | None:
    """What `carry_headers` carried for ``checkpoint``: each file one it lists in its folder (a plain file name);
    None for no carried headers, or another engine version's (the caller reads the files). `UnsafeRecord` naming
    the checkpoint for anything else."""
    data = _carried_json(checkpoint, _headers_tag(), "safetensors headers")
    if data is None:
        return None
    document = parse_json(data, checkpoint.url, error=UnsafeRecord)
    reader = _PlainReader(checkpoint.url, "carried safetensors headers")
    if not isinstance(document, dict) or set(document) != {"format", "files"} or document["format"] != HEADERS_FORMAT:
        raise UnsafeRecord("carried safetensors headers: not a document of this format", checkpoint.url)
    listed = {f.path for f in checkpoint.files if "/" not in f.path}
    out, seen = [], set()
    for entry in reader.items(document["files"], "files"):
        name, names, header = reader.items(entry, "a file", 3)
        name = reader.string(name, "a file name")
        if name not in listed or name in seen:
            raise UnsafeRecord(f"carried safetensors headers name the file {name!r}, which is not one the checkpoint "
                               "lists in its folder (or twice)", checkpoint.url)
        seen.add(name)
        if names is not None:
            names = [reader.string(n, "a tensor name") for n in reader.items(names, "tensor names")]
        if not isinstance(header, str):
            raise UnsafeRecord(f"carried safetensors headers: the header of {name} is not text", checkpoint.url)
        out.append((name, names, header.encode("utf-8")))
    return out
