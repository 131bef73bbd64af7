"""Read ``torch.save`` archives lazily and safely: structure first, bytes only on demand.

A ``torch.save`` file is an uncompressed zip holding ``<archive>/data.pkl`` (the object tree) and
one record ``<archive>/data/<key>`` per storage. `TorchArchive` parses the zip directory and the
pickle — kilobytes — and returns the object tree with every tensor replaced by a `StoredTensor`:
the file, byte offset, dtype, shape and strides of its data. Nothing of the tensors is read.

Integrity: every byte of a record read is folded into that record's CRC-32 as it is read
(`merge_engine.formats.zip_crc`); a record read whole is checked then, one read in part is completed and
checked by `TorchArchive.verify_reads`. A mismatch is `CorruptShard` naming the file and the record
(``torch.load`` checks none of this). ``data.pkl`` is read by ``zipfile``, which checks its CRC.

Safety: the pickle is read with an unpickler whose ``find_class`` answers exact (module, name) pairs
from an allow-list of *stand-ins written here*: no function or class of torch (or anything else) is
ever called while unpickling. Distributed-tensor classes (DTensor, DeviceMesh, placements,
ShardedTensor, DCP metadata, ...) become inert `Record` objects that only store their pickled state
(the exact pairs: `merge_engine.formats.pickle_globals`). A dotted name (an attribute walk out of a
module), any other global, and any ``getattr`` but a listed nested class raise `UnsafePickle` naming
the global and the file, before anything runs.
"""

from __future__ import annotations

import bisect
import io
import math
import pickle
import pickletools
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafePickle
from merge_engine.formats.dtype_names import (
    ALIASES, ITEMSIZES, STORAGE_CLASSES, DTypeByName, PickledDType, name_of,
)
from merge_engine.formats.pickle_globals import NESTED_RECORDS, RECORD_GLOBALS, is_plain_name
from merge_engine.storage import RangeReader
from merge_engine.formats.zip_crc import RecordChecks

if TYPE_CHECKING:  # torch is imported by the functions that read bytes into tensors, never by a check
    import torch

# --- stand-ins the unpickler may return ---------------------------------------------------


MAX_PICKLE_BYTES = 1 << 30  # a state dict's structure; tensors live in separate records
GATHER_ELEMENTS = 1 << 20  # non-contiguous reads: flat elements located per pass
GATHER_WINDOW_BYTES = 32 << 20  # non-contiguous reads: most storage bytes held at once
DTYPE_GLOBALS = frozenset(ITEMSIZES) | frozenset(ALIASES)  # ``torch.<name>`` globals that are dtypes


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely in row-major order (size-1 dims may have any stride)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class StorageMarker:
    """What a ``torch.FloatStorage``-style global unpickles to: only its element dtype's name."""

    dtype_name: str


@dataclass(frozen=True)
class StorageRef(DTypeByName):
    """A storage record in the archive: key, dtype name and element count (its bytes are found by key).

    ``dtype_name`` is canonical (`merge_engine.formats.dtype_names`); a ``torch.dtype`` given for it is
    stored as its name. ``dtype`` is the ``torch.dtype`` (imports torch), ``itemsize`` needs no torch.
    """

    key: str
    dtype_name: str
    numel: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", name_of(self.dtype_name))


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
    def dtype_name(self) -> str:
        return self.storage.dtype_name

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        return is_row_major(self.shape, self.stride)

    def read_flat(self, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start+count)`` of the row-major flattening, read into ``out`` (1-D) if given."""
        import torch

        if out is None:
            out = torch.empty(count, dtype=self.dtype)
        if count == 0:
            return out
        if self.is_contiguous():
            self.archive.read_storage_into(self.storage, self.offset + start, out)
            return out
        for at in range(0, count, GATHER_ELEMENTS):  # bounded index tensors: a few int64 per element
            self._gather(start + at, out[at:at + GATHER_ELEMENTS])
        return out

    @property
    def span(self) -> int:
        """Elements of the storage from the first to the last one this view reaches."""
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0

    def _gather(self, start: int, out: torch.Tensor) -> None:
        """Flat elements ``[start, start + len(out))`` of a non-contiguous view, read in storage
        windows of at most `GATHER_WINDOW_BYTES` (a transposed tensor's row touches its whole
        storage: memory stays bounded, and the bytes are read once per window they fall in)."""
        import torch

        count = out.numel()
        flat = torch.arange(start, start + count, dtype=torch.int64)
        index = torch.zeros(count, dtype=torch.int64)
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            index += (flat % size) * stride
            flat //= size
        del flat
        window = max(1, GATHER_WINDOW_BYTES // self.dtype.itemsize)
        low, high = int(index.min()), int(index.max()) + 1
        if high - low <= max(window, count):
            raw = torch.empty(high - low, dtype=self.dtype)
            self.archive.read_storage_into(self.storage, self.offset + low, raw)
            out.copy_(raw[index - low])
            return
        index, order = torch.sort(index)
        at = 0
        while at < count:
            first = int(index[at])
            stop = int(torch.searchsorted(index, first + window))
            raw = torch.empty(int(index[stop - 1]) + 1 - first, dtype=self.dtype)
            self.archive.read_storage_into(self.storage, self.offset + first, raw)
            out[order[at:stop]] = raw[index[at:stop] - first]
            at = stop

    def read(self) -> torch.Tensor:
        """The whole tensor, materialised (contiguous)."""
        import torch

        if self.is_contiguous():
            return self.read_flat(0, self.numel).reshape(self.shape)
        raw = torch.empty(self.span, dtype=self.dtype)
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
class WrapperTensor(DTypeByName):
    """A tensor subclass (DTensor) rebuilt without torch: class record, global meta and its state."""

    cls: type[Record]
    dtype_name: str
    shape: tuple[int, ...]
    state: dict[str, Any]


def view_problem(storage_numel: int, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> str | None:
    """None when the strided view ``(offset, shape, stride)`` is one a real tensor can be, else why not.

    A view must lie inside its storage (``offset + span <= storage_numel``) and never reach one
    element twice (no internal overlap: sorted by stride, each dim's stride is larger than every
    offset the smaller dims reach). Both together mean a view never claims more elements than its
    storage holds: a pickle cannot make one stored element stand for a billion (zero strides).
    """
    if len(shape) != len(stride):
        return f"shape {list(shape)} and strides {list(stride)} differ in length"
    if offset < 0 or any(s < 0 for s in shape) or any(st < 0 for st in stride):
        return f"negative offset, size or stride (offset {offset}, shape {list(shape)}, strides {list(stride)})"
    if any(s == 0 for s in shape):
        return None if offset <= storage_numel else f"offset {offset} lies past its storage of {storage_numel}"
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    if offset + span > storage_numel:
        return (f"view {list(shape)} (strides {list(stride)}) at offset {offset} needs {offset + span} elements; "
                f"its storage holds {storage_numel}")
    reach = 0
    for st, s in sorted((st, s) for s, st in zip(shape, stride) if s > 1):
        if st <= reach:
            return f"view {list(shape)} with strides {list(stride)} reaches some stored elements more than once"
        reach += (s - 1) * st
    return None


def _tensor_rebuilder(archive: TorchArchive):
    def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                           metadata=None):
        if not isinstance(storage, StorageRef):
            raise UnsafePickle(f"tensor rebuilt from a non-storage object {type(storage).__name__}", archive.url)
        try:
            offset, shape, strides = int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride)
        except (TypeError, ValueError):
            raise CorruptShard(f"tensor of storage {storage.key} has a non-integer offset, size or stride",
                               archive.url) from None
        problem = view_problem(storage.numel, offset, shape, strides)
        if problem:
            raise CorruptShard(f"tensor on storage {storage.key}: {problem}", archive.url)
        tensor = StoredTensor(archive, storage, offset, shape, strides)
        archive._views.append(tensor)
        return tensor

    def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
        """A dtype with no typed storage of its own (float8, uint16/32/64): torch saves an untyped (byte)
        storage and names the dtype here; the storage is read as that dtype, whole elements only."""
        if not isinstance(storage, StorageRef) or storage.dtype_name != "uint8":
            raise UnsafePickle(f"a dtype-named tensor rebuilt from {type(storage).__name__}, not an untyped storage",
                               archive.url)
        if not isinstance(dtype, PickledDType):
            raise UnsafePickle(f"a tensor rebuilt with dtype {dtype!r}", archive.url)
        itemsize = ITEMSIZES[name_of(dtype.name)]
        if storage.numel % itemsize:
            raise CorruptShard(f"storage {storage.key} holds {storage.numel} bytes: not whole {dtype.name} elements",
                               archive.url)
        typed = StorageRef(storage.key, dtype.name, storage.numel // itemsize)
        return _rebuild_tensor_v2(typed, storage_offset, size, stride, requires_grad, backward_hooks, metadata)

    return _rebuild_tensor_v2, _rebuild_tensor_v3


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    if not isinstance(dtype, PickledDType):
        raise ValueError(f"tensor subclass rebuilt with dtype {dtype!r}")
    return WrapperTensor(cls, dtype.name, tuple(int(s) for s in size), {})


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
    """Only ``getattr(<record class>, "<Nested>")`` for the exact pairs of `NESTED_RECORDS`: protocol 2
    pickles nested classes this way (``ShardedTensor.ProcessGroupState``). Anything else is refused."""
    if isinstance(owner, type) and issubclass(owner, Record) and isinstance(name, str) \
            and (owner.module, owner.qualname, name) in NESTED_RECORDS:
        return record_class(owner.module, f"{owner.qualname}.{name}")
    raise UnsafePickle(f"pickle calls getattr({owner!r}, {name!r}); only the nested record classes of the "
                       "allow-list are reached this way")


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

class _SafeUnpickler(pickle.Unpickler):
    """The allow-list unpickler. ``archive`` is None for a bare pickle (no storages allowed)."""

    def __init__(self, data: bytes, archive: TorchArchive | None, url: str | None = None) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._archive = archive
        self._url = archive.url if archive is not None else url

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not is_plain_name(name):  # ``a.b``: an attribute walk, never answered
            raise UnsafePickle(f"pickle asks for {module!s:.200}.{name!s:.200}: a dotted name walks attributes "
                               "out of its module; nothing was run", self._url)
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
            if self._archive is None:
                raise UnsafePickle("a bare pickle rebuilds a tensor; only torch.save archives hold tensors", self._url)
            return _Allowed(_tensor_rebuilder(self._archive)[name.endswith("v3")])
        if (module, name) == ("torch.storage", "UntypedStorage"):  # the bytes of a `_rebuild_tensor_v3` tensor
            return StorageMarker(STORAGE_CLASSES[name])
        if (module, name) in _FUNCTIONS:
            return _Allowed(_FUNCTIONS[(module, name)])
        if module == "torch" and name in STORAGE_CLASSES:
            return StorageMarker(STORAGE_CLASSES[name])
        if module == "torch" and name in DTYPE_GLOBALS:
            return PickledDType(name)
        if (module, name) in RECORD_GLOBALS:  # exact pairs only (`merge_engine.formats.pickle_globals`)
            return record_class(module, name)
        raise UnsafePickle(f"pickle asks for {module:.200}.{name:.200}, which is not on the allow-list; "
                           "nothing was run", self._url)

    def persistent_load(self, pid: Any) -> Any:
        if self._archive is None or not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickle(f"unknown persistent id {pid!r}", self._url)
        _, marker, key, _location, numel = pid
        dtype = marker.dtype_name if isinstance(marker, StorageMarker) else None
        if dtype is None:
            raise UnsafePickle(f"storage of unknown type {marker!r}", self._url)
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise CorruptShard(f"storage {key!r} has element count {numel!r}", self._url)
        ref = StorageRef(str(key), dtype, numel)
        self._archive.check_record(ref)
        return ref


MAX_TUPLE_DEPTH = 1000  # tuples nested deeper than this appear in no checkpoint (a Size, args, a DTensor)
_TUPLE_OPS = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"})


def check_nesting(data: bytes, url: str | None) -> None:
    """`CorruptShard` if the pickle ``data`` builds tuples nested deeper than `MAX_TUPLE_DEPTH`.

    Why: CPython hashes a tuple by recursing into its items without a recursion limit, so a
    pickle whose dict key is a tuple nested a million deep (3 bytes a level) crashes the process
    (SIGSEGV) inside the unpickler — no exception to catch. Tuples are immutable, so their depth
    is fixed when built: a scan of the opcodes (a stack of depths, memo included) finds it before
    anything is built. Fast path: depth is at most the number of tuple-building opcode bytes, so a
    pickle with few such bytes needs no scan.
    """
    wrapping = data.count(b"t") + data.count(b"\x85") + data.count(b"\x86") + data.count(b"\x87")
    if wrapping < MAX_TUPLE_DEPTH:
        return
    stack: list[int | None] = []  # tuple depth of each stack item; None for a MARK
    memo: dict[Any, int | None] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1] if stack else 0
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else 0
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg, 0))
            elif name == "MARK":
                stack.append(None)
            elif name == "DUP":
                stack.append(stack[-1] if stack else 0)
            else:
                deepest = 0
                before = op.stack_before
                if pickletools.markobject in before:  # pop to the mark, then the items below it
                    while stack and stack[-1] is not None:
                        deepest = max(deepest, stack.pop())
                    if stack:
                        stack.pop()
                    below = before.index(pickletools.markobject)
                else:
                    below = len(before)
                for _ in range(below):
                    item = stack.pop() if stack else 0
                    deepest = max(deepest, item or 0)
                depth = deepest + 1 if name in _TUPLE_OPS else 0
                if depth > MAX_TUPLE_DEPTH:
                    raise CorruptShard(f"pickle nests tuples more than {MAX_TUPLE_DEPTH} deep: not a checkpoint", url)
                stack.extend([depth] * len(op.stack_after))
    except ValueError as exc:  # a malformed opcode stream
        raise CorruptShard(f"pickle unreadable ({exc})", url) from None


def safe_unpickle(data: bytes, url: str) -> Any:
    """A bare pickle (no tensor storages) read with the same allow-list, e.g. a DCP ``.metadata``.

    Allow-listed classes come back as inert `Record`s; raises `UnsafePickle` for anything else
    and `CorruptShard` for a malformed stream, naming ``url``.
    """
    check_nesting(data, url)
    try:
        return _SafeUnpickler(data, None, url).load()
    except (UnsafePickle, CorruptShard) as exc:
        raise _naming(exc, url) from None
    except RecursionError:
        raise CorruptShard("pickle nests objects too deeply to be checkpoint metadata", url) from None
    except Exception as exc:  # malformed pickle stream
        raise CorruptShard(f"pickle unreadable ({type(exc).__name__}: {exc})", url) from exc


def _naming(error: CorruptShard, url: str | None) -> CorruptShard:
    """``error`` naming ``url`` (a stand-in called by the pickle raises it without knowing the file)."""
    return error if error.path is not None else type(error)(error.message, url)


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


class StorageRecordInfo(NamedTuple):
    """What reading a storage record needs of its zip entry (the fields of ``zipfile.ZipInfo`` used)."""

    filename: str
    header_offset: int
    file_size: int
    CRC: int
    compress_type: int = zipfile.ZIP_STORED


class TorchArchive:
    """One ``torch.save`` file opened for lazy reading. `load()` returns the object tree.

    Raises `IncompleteCheckpoint` for an empty file, `CorruptShard` for a file that is not a
    readable torch zip archive (truncated, foreign format, legacy non-zip pickle) and
    `UnsafePickle` for a pickle that needs a global outside the allow-list.

    Carried (a checked checkpoint's index, `merge_engine.layouts.tensor_index`), a parsed archive is plain
    data (`carried`): its URL, the size and version its reads are pinned to and the zip entries of its
    storage records; no reader, no tree, no byte read, never a pickle. Rebuilt (`from_carried`), it opens
    a reader pinned to that size and version (nothing is read) and serves the `StoredTensor` s rebuilt
    on it; it cannot `load()` again.
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
        if len({info.header_offset for info in self._infos.values()}) != len(self._zip.infolist()):
            raise CorruptShard("zip entries share bytes (two names for one record): not a torch.save file", url)
        # where each record's bytes must end: the next local header, or the central directory
        self._record_starts = sorted({info.header_offset for info in self._infos.values()} |
                                     {getattr(self._zip, "start_dir", self.reader.size)})
        self._data_offsets: dict[str, int] = {}
        self._checked_records: set[tuple[str, int]] = set()
        self._views: list[StoredTensor] = []
        self._loaded: Any = None
        self._crc = RecordChecks(url)

    def load(self) -> Any:
        """The object tree with `StoredTensor` leaves (parsed once, then cached)."""
        if self._loaded is None:
            if self._zip is None:
                raise ValueError(f"{self.url}: a carried archive serves its tensors, its tree stays with the check")
            info = self._infos[self._prefix + "data.pkl"]
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > MAX_PICKLE_BYTES:
                raise CorruptShard(f"data.pkl is compressed or {info.file_size} bytes: not what torch.save writes",
                                   self.url)
            try:
                data = self._zip.read(self._prefix + "data.pkl")
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise CorruptShard(f"data.pkl unreadable ({exc})", self.url) from exc
            self._check_byte_order()
            check_nesting(data, self.url)
            try:
                tree = _SafeUnpickler(data, self).load()
            except (UnsafePickle, CorruptShard) as exc:
                raise _naming(exc, self.url) from None
            except RecursionError:
                raise CorruptShard("pickle nests objects too deeply to be a state dict", self.url) from None
            except Exception as exc:  # malformed pickle stream
                raise CorruptShard(f"pickle unreadable ({type(exc).__name__}: {exc})", self.url) from exc
            self._check_views_disjoint()
            self._loaded = tree
        return self._loaded

    def _check_byte_order(self) -> None:
        """torch.save records the writer's byte order; the bytes are read as little-endian, so a
        big-endian archive would come back as wrong values: refused. (No record: little, as torch.)"""
        info = self._infos.get(self._prefix + "byteorder")
        if info is None:
            return
        try:
            order = self._zip.read(info.filename) if info.file_size <= 16 else b""
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise CorruptShard(f"byteorder record unreadable ({exc})", self.url) from exc
        if order != b"little":
            raise CorruptShard(f"byteorder record says {order[:16]!r}; only little-endian archives are read",
                               self.url)

    def check_record(self, storage: StorageRef) -> None:
        """The record behind ``storage`` exists, is stored uncompressed, holds exactly the bytes the
        pickle declares, and fits before the next record (zip directory only, no read). `load()` calls
        this for every storage, so a listing judged complete is one `merge` can read."""
        if (storage.key, storage.numel * storage.itemsize) in self._checked_records:
            return
        name = f"{self._prefix}data/{storage.key}"
        info = self._infos.get(name)
        if info is None:
            raise CorruptShard(f"storage record {name} missing", self.url)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptShard(f"storage record {name} is compressed; torch.save never does that", self.url)
        expected = storage.numel * storage.itemsize
        if info.file_size != expected:
            raise CorruptShard(f"storage record {name} holds {info.file_size} bytes, pickle says {expected}", self.url)
        end = info.header_offset + 30 + len(getattr(info, "orig_filename", info.filename).encode()) + info.file_size
        if end > self._record_end(info.header_offset):
            raise CorruptShard(f"storage record {name} of {info.file_size} bytes overruns the next record or "
                               "the end of the archive", self.url)
        self._checked_records.add((storage.key, expected))

    def _record_end(self, header_offset: int) -> int:
        at = bisect.bisect_right(self._record_starts, header_offset)
        return self._record_starts[at] if at < len(self._record_starts) else self.reader.size

    def _check_views_disjoint(self) -> None:
        """No two tensors of this archive claim the same stored bytes, unless they are the same
        bytes (one tensor saved under two names, or ``w`` and ``w.view(-1)``: tied weights).

        Each view is already inside its storage with no internal overlap (`view_problem`); here,
        per record, distinct dense views must not overlap and all distinct views together claim at
        most the record's bytes. So a merge writes at most the bytes on disk once, plus aliases.
        """
        by_record: dict[str, set[tuple[int, int, bool, tuple]]] = {}
        for view in self._views:
            if not view.numel:
                continue
            size = view.itemsize
            span = 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride))
            start = view.offset * size
            dense = span == view.numel
            key = () if dense else (view.shape, view.stride, size)  # dense: the byte interval is the identity
            by_record.setdefault(view.storage.key, set()).add((start, start + span * size, dense, key))
        for record, views in by_record.items():
            claimed = 0
            dense_end = -1
            for start, end, dense, key in sorted(views):
                claimed += (end - start) if dense else math.prod(key[0]) * key[2]
                if dense:
                    if start < dense_end:
                        raise CorruptShard(f"two tensors overlap in storage record {record} "
                                           f"(bytes {start}-{end} meet a view ending at {dense_end})", self.url)
                    dense_end = end
            record_bytes = self._infos[f"{self._prefix}data/{record}"].file_size
            if claimed > record_bytes:
                raise CorruptShard(f"tensors claim {claimed} bytes of storage record {record}, which holds "
                                   f"{record_bytes}: overlapping views", self.url)

    def _data_offset(self, storage: StorageRef) -> int:
        offset = self._data_offsets.get(storage.key)
        if offset is not None:
            return offset
        self.check_record(storage)
        name = f"{self._prefix}data/{storage.key}"
        info = self._infos[name]
        header = self.reader.read(info.header_offset, 30)
        if header[:4] != b"PK\x03\x04":
            raise CorruptShard(f"bad local header for {name}", self.url)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = info.header_offset + 30 + name_len + extra_len
        if offset + info.file_size > self.reader.size:
            raise IncompleteCheckpoint(f"storage record {name} runs past the end of the file: truncated", self.url)
        if offset + info.file_size > self._record_end(info.header_offset):
            raise CorruptShard(f"storage record {name}: its local header places it over the next record", self.url)
        self._data_offsets[storage.key] = offset
        return offset

    def read_storage_into(self, storage: StorageRef, element_offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor ``out`` with elements of ``storage`` starting at ``element_offset``."""
        import torch

        if out.dtype != storage.dtype or not out.is_contiguous():
            raise ValueError("out must be contiguous and of the storage dtype")
        if element_offset + out.numel() > storage.numel:
            raise CorruptShard(f"tensor view runs past its storage {storage.key}", self.url)
        record_offset = element_offset * storage.itemsize
        start = self._data_offset(storage) + record_offset
        data = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        self.reader.read_into(start, data)
        info = self._infos[f"{self._prefix}data/{storage.key}"]
        self._crc.add(info.filename, info.file_size, info.CRC, record_offset, data)

    def verify_reads(self) -> None:
        """Check the CRC-32 of every record read from so far: what was left unread of each is read now
        (bounded chunks). `CorruptShard` naming the file and the record on a mismatch. Records read
        whole were checked as their last piece arrived (`merge_engine.formats.zip_crc`)."""
        def read(name: str, offset: int, length: int) -> memoryview:
            key = name[len(f"{self._prefix}data/"):]
            return memoryview(self.reader.read(self._data_offsets[key] + offset, length))

        def describe(name: str) -> tuple[int, int]:
            info = self._infos[name]
            return info.file_size, info.CRC

        self._crc.finish(read, describe)

    @property
    def records_checked(self) -> frozenset[str]:
        """The zip records read whole and found to match their CRC-32."""
        return self._crc.checked

    def close(self) -> None:
        self.reader.close()

    def carried(self) -> dict[str, Any]:
        """A parsed archive as plain data (JSON-ready: str, int, lists): its URL, the size and version its
        reads are pinned to, and the zip entries of its storage records. `from_carried` rebuilds it."""
        if self._loaded is None and self._zip is not None:
            raise ValueError(f"{self.url}: only a parsed archive is carried (call load() first)")
        data = f"{self._prefix}data/"
        records = [[info.filename, info.header_offset, info.file_size, info.CRC]
                   for name, info in sorted(self._infos.items()) if name.startswith(data)
                   and info.compress_type == zipfile.ZIP_STORED]
        return {"url": self.url, "size": self.reader.size, "version": self.reader.version, "prefix": self._prefix,
                "records": records, "starts": list(self._record_starts)}

    @classmethod
    def from_carried(cls, url: str, size: int, version: str, prefix: str,
                     records: list[StorageRecordInfo], starts: list[int]) -> TorchArchive:
        """The archive `carried` described, over a reader pinned to ``size`` and ``version`` (nothing is
        read). It serves the `StoredTensor` s built on it (each storage checked with `check_record`
        against ``records``: zip directory only); it cannot `load()` again. The caller validates the
        values (`merge_engine.layouts.tensor_index`): this only assembles them."""
        self = cls.__new__(cls)
        self.url = url
        self.reader = RangeReader(url, size, version)
        self._zip = None
        self._prefix = prefix
        self._infos = {info.filename: info for info in records}
        self._record_starts = list(starts)
        self._data_offsets = {}
        self._checked_records = set()
        self._views = []
        self._loaded = None
        self._crc = RecordChecks(url)
        return self
