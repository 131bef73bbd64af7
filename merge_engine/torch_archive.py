"""Read ``torch.save`` archives lazily and safely: structure first, bytes only on demand.

A ``torch.save`` file is an uncompressed zip holding ``<archive>/data.pkl`` (the object tree) and
one record ``<archive>/data/<key>`` per storage. `TorchArchive` parses the zip directory and the
pickle — kilobytes — and returns the object tree with every tensor replaced by a `StoredTensor`:
the file, byte offset, dtype, shape and strides of its data. Nothing of the tensors is read.

Safety: the pickle is read with an unpickler whose ``find_class`` answers from an allow-list of
*stand-ins written here*: no function or class of torch (or anything else) is ever called while
unpickling. Distributed-tensor classes (DTensor, DeviceMesh, placements, ShardedTensor, ...)
become inert `Record` objects that only store their pickled state. Any other global raises
`UnsafePickle` naming the global and the file, before anything runs.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafePickle
from merge_engine.storage import RangeReader

# --- stand-ins the unpickler may return ---------------------------------------------------


def _storage_dtypes() -> dict[str, torch.dtype]:
    import warnings

    table = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy typed-storage classes warn on attribute access
        return _collect_storage_dtypes(table)


def _collect_storage_dtypes(table: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    for name in dir(torch):
        if name.endswith("Storage") and name not in ("Storage", "TypedStorage", "UntypedStorage"):
            try:
                table[name] = getattr(torch, name).dtype
            except Exception:  # quantized storages have no plain dtype: leave them out
                continue
    table["UntypedStorage"] = torch.uint8
    return table


STORAGE_DTYPES = _storage_dtypes()
MAX_PICKLE_BYTES = 1 << 30  # a state dict's structure; tensors live in separate records
TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


@dataclass(frozen=True)
class StorageMarker:
    """What a ``torch.FloatStorage``-style global unpickles to: only its element dtype."""

    dtype: torch.dtype


@dataclass(frozen=True)
class StorageRef:
    """A storage record in the archive: key, dtype and element count (its bytes are found by key)."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as stored: a strided view on a storage record of a file. Holds no data.

    ``archive`` is the file object that owns the bytes: anything with ``url`` and
    ``read_storage_into(storage, element_offset, out)`` (`TorchArchive`, `SafetensorsFile`).
    """

    archive: Any
    storage: StorageRef
    offset: int  # in elements, into the storage
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read_flat(self, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start+count)`` of the row-major flattening, read into ``out`` (1-D) if given."""
        if out is None:
            out = torch.empty(count, dtype=self.dtype)
        if count == 0:
            return out
        if self.is_contiguous():
            self.archive.read_storage_into(self.storage, self.offset + start, out)
            return out
        out.copy_(self.read().reshape(-1)[start:start + count])
        return out

    def read(self) -> torch.Tensor:
        """The whole tensor, materialised (contiguous)."""
        if self.is_contiguous():
            return self.read_flat(0, self.numel).reshape(self.shape)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0
        raw = torch.empty(span, dtype=self.dtype)
        self.archive.read_storage_into(self.storage, self.offset, raw)
        return torch.as_strided(raw, self.shape, self.stride).contiguous()


class _FrozenClass(type):
    """Record classes are shared by every load: a pickle may not set attributes on them (BUILD
    with slot state calls setattr on whatever object it is given)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise UnsafePickle(f"pickle tries to set {name!r} on the allow-listed class {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise UnsafePickle(f"pickle tries to delete {name!r} from the allow-listed class {cls.__name__}")


class Record(metaclass=_FrozenClass):
    """An inert stand-in for an allow-listed class: keeps constructor args and pickled state."""

    module = ""
    qualname = ""

    def __new__(cls, *args: Any) -> Record:  # NEWOBJ calls __new__ only; REDUCE calls the class
        self = super().__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def fields(self) -> dict[str, Any]:
        """The pickled attributes as one dict (plain ``__dict__`` state or ``(dict, slots)`` state)."""
        state = self.state
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, (dict, type(None))) for s in state):
            merged: dict[str, Any] = {}
            for part in state:
                merged.update(part or {})
            return merged
        return {}

    def __repr__(self) -> str:
        return f"<{self.module}.{self.qualname} args={self.args!r} state={self.state!r}>"


_record_classes: dict[tuple[str, str], type[Record]] = {}


def record_class(module: str, qualname: str) -> type[Record]:
    key = (module, qualname)
    if key not in _record_classes:
        _record_classes[key] = _FrozenClass(qualname, (Record,), {"module": module, "qualname": qualname})
    return _record_classes[key]


class _Allowed:
    """A fresh, immutable wrapper around an allow-listed callable for each use in a pickle, so that
    no pickle can alter a function or class the next load will use (BUILD on it raises)."""

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickle(f"pickle tries to set {name!r} on an allow-listed callable")

    def __setstate__(self, state: Any) -> None:
        raise UnsafePickle("pickle tries to modify an allow-listed callable")


@dataclass
class WrapperTensor:
    """A tensor subclass (DTensor) rebuilt without torch: class record, global meta and its state."""

    cls: type[Record]
    dtype: torch.dtype
    shape: tuple[int, ...]
    state: dict[str, Any]


def _tensor_rebuilder(archive: TorchArchive):
    def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                           metadata=None):
        if not isinstance(storage, StorageRef):
            raise UnsafePickle(f"tensor rebuilt from a non-storage object {type(storage).__name__}", archive.url)
        return StoredTensor(archive, storage, int(storage_offset), tuple(int(s) for s in size),
                            tuple(int(s) for s in stride))

    return _rebuild_tensor_v2


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    return WrapperTensor(cls, dtype, tuple(int(s) for s in size), {})


def _rebuild_from_type_v2(func, new_type, args, state):
    value = func(*args)
    if isinstance(value, WrapperTensor):
        parts = state if isinstance(state, tuple) else (state,)
        if all(isinstance(part, (dict, type(None))) for part in parts):
            for part in parts:  # ``__dict__`` state, or ``(dict_state, slots_state)``
                value.state.update(part or {})
        else:  # a class with its own __getstate__ (ShardedTensor): kept as pickled
            value.state["__state__"] = state
    return value


def _record_getattr(owner, name):
    """Only ``getattr(<record class>, "Nested")``: protocol 2 pickles nested classes this way
    (``ShardedTensor.ProcessGroupState``). Anything else is refused."""
    if isinstance(owner, type) and issubclass(owner, Record) and isinstance(name, str) and name.isidentifier():
        return record_class(owner.module, f"{owner.qualname}.{name}")
    raise UnsafePickle(f"pickle calls getattr({owner!r}, {name!r}); only nested record classes are allowed")


class TensorClassMarker:
    """``torch.Tensor`` as a ``_rebuild_from_type_v2`` target: plain tensors need no class."""


def _torch_size(values=()):
    return tuple(int(v) for v in values)


def _torch_device(*args):
    return ":".join(str(a) for a in args)


def _get_layout(name):
    return str(name)


def _codecs_encode(text, encoding="utf-8"):
    import codecs

    return codecs.encode(text, encoding)


_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "getattr"): _record_getattr,
    ("__builtin__", "getattr"): _record_getattr,
    ("torch", "Tensor"): TensorClassMarker,
    ("torch.nn.parameter", "Parameter"): TensorClassMarker,
    ("torch", "Size"): _torch_size,
    ("torch", "device"): _torch_device,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.serialization", "_get_layout"): _get_layout,
}

# Modules whose classes may appear as inert records (their code is never run).
_RECORD_MODULES = ("torch.distributed.",)
# Single globals that may appear as inert records: Megatron-LM pickles its ``args`` (an
# argparse.Namespace) and numpy RNG state (arrays rebuilt by ``_reconstruct``) beside the weights.
# A record only stores the arguments and state it is given; no argparse or numpy code runs.
_RECORD_GLOBALS = frozenset({
    ("argparse", "Namespace"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
})
_RECORD_GLOBAL_MODULES = ("numpy.dtypes",)  # numpy 2 pickles dtypes as numpy.dtypes.UInt32DType etc.


class _SafeUnpickler(pickle.Unpickler):
    """The allow-list unpickler. ``archive`` is None for a bare pickle (no storages allowed)."""

    def __init__(self, data: bytes, archive: TorchArchive | None, url: str | None = None) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._archive = archive
        self._url = archive.url if archive is not None else url

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            if self._archive is None:
                raise UnsafePickle("a bare pickle rebuilds a tensor; only torch.save archives hold tensors", self._url)
            return _Allowed(_tensor_rebuilder(self._archive))
        if (module, name) in _FUNCTIONS:
            return _Allowed(_FUNCTIONS[(module, name)])
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageMarker(STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if module.startswith(_RECORD_MODULES) or module == "torch.distributed":
            return record_class(module, name)
        if (module, name) in _RECORD_GLOBALS or (module in _RECORD_GLOBAL_MODULES and name.endswith("DType")):
            return record_class(module, name)
        raise UnsafePickle(f"pickle asks for {module}.{name}, which is not on the allow-list; nothing was run",
                           self._url)

    def persistent_load(self, pid: Any) -> Any:
        if self._archive is None or not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickle(f"unknown persistent id {pid!r}", self._url)
        _, marker, key, _location, numel = pid
        dtype = marker.dtype if isinstance(marker, StorageMarker) else None
        if dtype is None:
            raise UnsafePickle(f"storage of unknown type {marker!r}", self._url)
        return StorageRef(str(key), dtype, int(numel))


def safe_unpickle(data: bytes, url: str) -> Any:
    """A bare pickle (no tensor storages) read with the same allow-list, e.g. a DCP ``.metadata``.

    Allow-listed classes come back as inert `Record`s; raises `UnsafePickle` for anything else
    and `CorruptShard` for a malformed stream, naming ``url``.
    """
    try:
        return _SafeUnpickler(data, None, url).load()
    except (UnsafePickle, CorruptShard):
        raise
    except Exception as exc:  # malformed pickle stream
        raise CorruptShard(f"pickle unreadable ({type(exc).__name__}: {exc})", url) from exc


class _ReaderFile(io.RawIOBase):
    """A seekable read-only file over a `RangeReader`, so ``zipfile`` can parse the directory."""

    def __init__(self, reader: RangeReader) -> None:
        self._reader = reader
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._reader.size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._reader.size - self._pos))
        if n:
            self._reader.read_into(self._pos, memoryview(buffer)[:n])
        self._pos += n
        return n


class TorchArchive:
    """One ``torch.save`` file opened for lazy reading. `load()` returns the object tree.

    Raises `IncompleteCheckpoint` for an empty file, `CorruptShard` for a file that is not a
    readable torch zip archive (truncated, foreign format, legacy non-zip pickle) and
    `UnsafePickle` for a pickle that needs a global outside the allow-list.
    """

    def __init__(self, url: str, reader: RangeReader | None = None) -> None:
        self.url = url
        self.reader = reader or RangeReader(url)
        if self.reader.size == 0:
            raise IncompleteCheckpoint("file is empty (0 bytes)", url)
        try:
            self._zip = zipfile.ZipFile(_ReaderFile(self.reader))
            names = self._zip.namelist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise CorruptShard(f"not a readable torch zip archive ({exc}); truncated, still being written, or not a torch file", url) from exc
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptShard("zip archive without a single data.pkl: not a torch.save file", url)
        self._prefix = pkl[0][: -len("data.pkl")]
        self._infos = {info.filename: info for info in self._zip.infolist()}
        self._data_offsets: dict[str, int] = {}
        self._loaded: Any = None

    def load(self) -> Any:
        """The object tree with `StoredTensor` leaves (parsed once, then cached)."""
        if self._loaded is None:
            info = self._infos[self._prefix + "data.pkl"]
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > MAX_PICKLE_BYTES:
                raise CorruptShard(f"data.pkl is compressed or {info.file_size} bytes: not what torch.save writes",
                                   self.url)
            try:
                data = self._zip.read(self._prefix + "data.pkl")
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise CorruptShard(f"data.pkl unreadable ({exc})", self.url) from exc
            try:
                tree = _SafeUnpickler(data, self).load()
            except (UnsafePickle, CorruptShard):
                raise
            except Exception as exc:  # malformed pickle stream
                raise CorruptShard(f"pickle unreadable ({type(exc).__name__}: {exc})", self.url) from exc
            self._loaded = tree
        return self._loaded

    def _data_offset(self, storage: StorageRef) -> int:
        offset = self._data_offsets.get(storage.key)
        if offset is not None:
            return offset
        name = f"{self._prefix}data/{storage.key}"
        info = self._infos.get(name)
        if info is None:
            raise CorruptShard(f"storage record {name} missing", self.url)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptShard(f"storage record {name} is compressed; torch.save never does that", self.url)
        expected = storage.numel * storage.dtype.itemsize
        if info.file_size != expected:
            raise CorruptShard(f"storage record {name} holds {info.file_size} bytes, pickle says {expected}", self.url)
        header = self.reader.read(info.header_offset, 30)
        if header[:4] != b"PK\x03\x04":
            raise CorruptShard(f"bad local header for {name}", self.url)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = info.header_offset + 30 + name_len + extra_len
        if offset + info.file_size > self.reader.size:
            raise IncompleteCheckpoint(f"storage record {name} runs past the end of the file: truncated", self.url)
        self._data_offsets[storage.key] = offset
        return offset

    def read_storage_into(self, storage: StorageRef, element_offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor ``out`` with elements of ``storage`` starting at ``element_offset``."""
        if out.dtype != storage.dtype or not out.is_contiguous():
            raise ValueError("out must be contiguous and of the storage dtype")
        if element_offset + out.numel() > storage.numel:
            raise CorruptShard(f"tensor view runs past its storage {storage.key}", self.url)
        start = self._data_offset(storage) + element_offset * storage.dtype.itemsize
        self.reader.read_into(start, memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b""))

    def close(self) -> None:
        self.reader.close()
