"""The allow-list unpickler: a pickle read without running anything it names.

Safety: the pickle is read with an unpickler whose ``find_class`` answers exact (module, name) pairs
from an allow-list of *stand-ins written here*: no function or class of torch (or anything else) is
ever called while unpickling. Distributed-tensor classes (DTensor, DeviceMesh, placements,
ShardedTensor, DCP metadata, ...) become inert `Record` objects that only store their pickled state
(the exact pairs: `merge_engine.formats.pickle_globals`). A dotted name (an attribute walk out of a
module), any other global, and any ``getattr`` but a listed nested class raise `UnsafePickle` naming
the global and the file, before anything runs.

`SafeUnpickler(data, archive)` reads a ``torch.save`` archive's ``data.pkl`` (its tensors rebuilt as
`merge_engine.formats.stored_tensor.StoredTensor` views on the archive's storage records); `safe_unpickle`
reads a bare pickle (no storages: a DCP ``.metadata``). `check_nesting` refuses, before any object is built,
tuples nested deep enough to crash the interpreter.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, cast

from merge_engine.errors import CorruptShard, UnsafePickle
from merge_engine.formats.dtype_names import ALIASES, ITEMSIZES, STORAGE_CLASSES, DTypeByName, PickledDType, name_of
from merge_engine.formats.pickle_globals import NESTED_RECORDS, RECORD_GLOBALS, is_plain_name
from merge_engine.formats.stored_tensor import StorageRef, StoredTensor, view_problem


class StorageArchive(Protocol):
    """The archive whose storage records a pickle's tensors are views on (`merge_engine.formats.torch_archive`):
    it checks each storage the pickle declares and keeps each view rebuilt on them."""

    url: str

    def check_record(self, storage: StorageRef) -> None: ...

    def keep_view(self, view: StoredTensor) -> None: ...


# --- stand-ins the unpickler may return ---------------------------------------------------

DTYPE_GLOBALS = frozenset(ITEMSIZES) | frozenset(ALIASES)  # ``torch.<name>`` globals that are dtypes


@dataclass(frozen=True)
class StorageMarker:
    """What a ``torch.FloatStorage``-style global unpickles to: only its element dtype's name."""

    dtype_name: str


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
    args: tuple[Any, ...]
    state: Any

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
        made = _FrozenClass(qualname, (Record,), {"module": module, "qualname": qualname})
        _record_classes[key] = cast("type[Record]", made)  # a subclass of Record, made by its metaclass
    return _record_classes[key]


class _Allowed:
    """A fresh, immutable wrapper around an allow-listed callable for each use in a pickle, so that
    no pickle can alter a function or class the next load will use (BUILD on it raises)."""

    __slots__ = ("_target",)
    _target: Any

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


def _tensor_rebuilder(archive: StorageArchive):
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
        archive.keep_view(tensor)
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

class SafeUnpickler(pickle.Unpickler):
    """The allow-list unpickler. ``archive`` is None for a bare pickle (no storages allowed)."""

    def __init__(self, data: bytes, archive: StorageArchive | None, url: str | None = None) -> None:
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
                        deepest = max(deepest, stack.pop() or 0)  # not None: the mark stops the loop
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
        return SafeUnpickler(data, None, url).load()
    except (UnsafePickle, CorruptShard) as exc:
        raise naming_url(exc, url) from None
    except RecursionError:
        raise CorruptShard("pickle nests objects too deeply to be checkpoint metadata", url) from None
    except Exception as exc:  # malformed pickle stream
        raise CorruptShard(f"pickle unreadable ({type(exc).__name__}: {exc})", url) from exc


def naming_url(error: CorruptShard, url: str | None) -> CorruptShard:
    """``error`` naming ``url`` (a stand-in called by the pickle raises it without knowing the file)."""
    return error if error.path is not None else type(error)(error.message, url)
