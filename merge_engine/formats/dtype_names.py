"""Tensor dtypes by name, without torch: what a check needs of a dtype is its name and its item size.

A check reads headers (a ``torch.save`` pickle, a safetensors header) and proves sizes; it never
touches a tensor, so it need not import torch. The records it builds
(`merge_engine.formats.stored_tensor.StorageRef`, the assemblies of `merge_engine.formats.tensor_source`)
hold a dtype's canonical NAME (torch's spelling: ``"bfloat16"``); their ``dtype`` property asks
`torch_dtype` for the real ``torch.dtype`` (importing torch then), so engine code that casts, compares
or allocates still sees exactly the ``torch.dtype`` it saw before.

Contract:
- `ITEMSIZES`: canonical name -> bytes per element, for every dtype torch has
  (`tests/merge_engine/formats/test_dtype_names.py` checks the table against the installed torch);
  `ALIASES`: torch's other spellings (``half``, ``long``...) -> the canonical name.
- `STORAGE_CLASSES`: the ``torch.save`` typed-storage globals (``BFloat16Storage``...) -> dtype name.
- `SAFETENSORS_CODES`: safetensors header codes (``"BF16"``) -> dtype name.
- `canonical(name)` -> canonical name, `KeyError` for a name torch does not have.
- `name_of(value)` -> canonical name of a name, a `PickledDType` or a real ``torch.dtype`` (read from
  its text: no torch import); `TypeError` for anything else.
- `torch_dtype(name)` -> the ``torch.dtype`` (imports torch).
- `DTypeByName`: the ``dtype`` and ``itemsize`` of every record that holds a ``dtype_name``.
- `PickledDType`: what the allow-list unpickler returns for a pickled ``torch.<dtype>`` global. It is
  equal only to a `PickledDType` of the same name; comparing it with a ``torch.dtype`` raises
  `TypeError` (a silent False there would be a silent wrong merge).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

ITEMSIZES: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
    "bfloat16": 2, "quint4x2": 1, "quint2x4": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
    "bits16": 2, "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1,
    "uint6": 1, "uint7": 1, "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}
ALIASES: dict[str, str] = {
    "short": "int16", "int": "int32", "long": "int64", "half": "float16", "float": "float32", "double": "float64",
    "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128", "bit": "uint1",
}
STORAGE_CLASSES: dict[str, str] = {
    "BFloat16Storage": "bfloat16", "BoolStorage": "bool", "ByteStorage": "uint8", "CharStorage": "int8",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64", "DoubleStorage": "float64",
    "FloatStorage": "float32", "HalfStorage": "float16", "IntStorage": "int32", "LongStorage": "int64",
    "QInt32Storage": "qint32", "QInt8Storage": "qint8", "QUInt2x4Storage": "quint2x4",
    "QUInt4x2Storage": "quint4x2", "QUInt8Storage": "quint8", "ShortStorage": "int16",
    "UntypedStorage": "uint8",
}
SAFETENSORS_CODES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}


def canonical(name: str) -> str:
    """The canonical spelling of a torch dtype name (``"half"`` -> ``"float16"``); `KeyError` if none."""
    if name in ITEMSIZES:
        return name
    return ALIASES[name]


def is_torch_dtype(value: Any) -> bool:
    """Whether ``value`` is a real ``torch.dtype`` (without importing torch)."""
    kind = type(value)
    return kind.__module__ == "torch" and kind.__name__ == "dtype"


def name_of(value: Any) -> str:
    """The canonical name of a dtype given as a name, a `PickledDType` or a ``torch.dtype``."""
    if isinstance(value, PickledDType):
        return value.name
    if isinstance(value, str):
        return canonical(value)
    if is_torch_dtype(value):
        return canonical(str(value).removeprefix("torch."))
    raise TypeError(f"not a dtype: {value!r}")


def itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name`` (canonical)."""
    return ITEMSIZES[name]


def describe(name: str) -> str:
    """The dtype as ``str(torch.dtype)`` prints it (``torch.bfloat16``), for messages."""
    return f"torch.{name}"


@lru_cache(maxsize=None)
def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` named ``name`` (imports torch: only the read and write paths ask)."""
    import torch

    dtype = getattr(torch, canonical(name))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch.{name} is not a dtype")
    return dtype


class DTypeByName:
    """For a record that holds a canonical ``dtype_name``: ``dtype`` (the ``torch.dtype``: imports torch) and
    ``itemsize`` (bytes per element: no torch)."""

    __slots__ = ()
    dtype_name: str  # the subclass's field

    @property
    def dtype(self) -> Any:
        return torch_dtype(self.dtype_name)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype_name]


class PickledDType:
    """A ``torch.<dtype>`` global read from a pickle without torch: its canonical ``name``."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", canonical(name))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a PickledDType is immutable")

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.name]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PickledDType):
            return self.name == other.name
        if is_torch_dtype(other):
            raise TypeError(f"a pickled dtype ({self.name}) compared with {other}: compare names "
                            "(merge_engine.formats.dtype_names.name_of) or resolve it with torch_dtype()")
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(("PickledDType", self.name))

    def __reduce__(self) -> tuple:
        return PickledDType, (self.name,)

    def __repr__(self) -> str:
        return describe(self.name)
