"""The safetensors format, read lazily over any URL: header first, tensor bytes by ranged reads.

One parser for the whole engine (merging, fusing, validating). `read_header` checks what the
safetensors library checks: a JSON-object header that fits the file, known dtypes, byte ranges
that match dtype and shape, start at or after the data section, never overlap, and end exactly
at the end of the file. `SafetensorsFile(url).tensors()` then gives `StoredTensor`s — the same
lazy handle torch archives give — so every reader downstream treats both formats alike.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.formats.dtype_names import ITEMSIZES, SAFETENSORS_CODES, DTypeByName, describe, torch_dtype
from merge_engine.formats.stored_tensor import StorageRef, StoredTensor
from merge_engine.storage import RangeReader
from merge_engine.storage.json_text import parse_json

if TYPE_CHECKING:  # a header is read without torch (a check); the byte reads import it
    import torch


def __getattr__(name: str) -> Any:
    """``DTYPES`` (code -> ``torch.dtype``) and ``CODES`` (``torch.dtype`` -> code), built on first use:
    the writers and validators that ask for them work with torch dtypes; a header read needs neither."""
    if name in ("DTYPES", "CODES"):
        return _torch_tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@lru_cache(maxsize=1)
def _torch_tables() -> dict[str, dict]:
    return {"DTYPES": {code: torch_dtype(dtype) for code, dtype in SAFETENSORS_CODES.items()},
            "CODES": {torch_dtype(dtype): code for code, dtype in SAFETENSORS_CODES.items()}}


MAX_HEADER = 100 * 1024 * 1024
# Tensors one file may list. Each costs ~1 KB to parse and ~2 KB through a merge, while its header entry is
# ~70 bytes: 1.34 M zero-size entries fit MAX_HEADER and cost 2.9 GB. Real shards list a few thousand (a
# DeepSeek-V3 shard ~560, a whole unsharded 128-expert MoE ~20 000).
MAX_TENSORS = 1 << 17


@dataclass(frozen=True)
class HeaderEntry(DTypeByName):
    """One tensor of a safetensors file: dtype (by name; ``dtype`` imports torch), shape and absolute
    byte range in the file."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    entries: dict[str, HeaderEntry]
    metadata: dict[str, Any]
    data_start: int
    raw: bytes = field(default=b"", repr=False)  # the header's JSON as stored: what a check carries (plain data)


def read_header(reader: RangeReader) -> Header:
    """The checked header of the file behind ``reader`` (two small reads).

    Raises `IncompleteCheckpoint` for a file too short for what its header promises (truncated),
    `CorruptShard` for anything else that is not a valid safetensors file, or one listing more than
    `MAX_TENSORS` tensors; both name the file.
    """
    url = reader.url
    if reader.size < 8:
        raise IncompleteCheckpoint(f"safetensors file of {reader.size} bytes: empty or truncated", url)
    (length,) = struct.unpack("<Q", reader.read(0, 8))
    if length > min(MAX_HEADER, reader.size - 8):
        raise CorruptShard(f"safetensors header length {length} impossible for a {reader.size}-byte file", url)
    return parse_header(url, reader.size, reader.read(8, length))


def parse_header(url: str, size: int, data: bytes) -> Header:
    """The checked header whose JSON is ``data``, of the ``size``-byte file at ``url`` (`read_header`'s checks,
    no read: a header a check carried is checked again exactly as the file's)."""
    length = len(data)
    if length > min(MAX_HEADER, size - 8):
        raise CorruptShard(f"safetensors header length {length} impossible for a {size}-byte file", url)
    # each entry is an object, as are the header and its metadata: a bound counted before any entry is built
    objects = bytes(data).count(b"{")
    if objects > MAX_TENSORS + 2:
        raise CorruptShard(f"safetensors header of {length} bytes holds {objects} objects: more than the "
                           f"{MAX_TENSORS} tensors one file may list", url)
    raw = parse_json(data, url, unique_keys=True)  # CorruptShard: not JSON, too deep, a key twice
    if not isinstance(raw, dict):
        raise CorruptShard("safetensors header is not a JSON object", url)
    if len(raw) - ("__metadata__" in raw) > MAX_TENSORS:
        raise CorruptShard(f"safetensors header lists {len(raw)} tensors: more than the {MAX_TENSORS} tensors one "
                           "file may list", url)
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptShard("safetensors __metadata__ is not an object of strings", url)
    data_start = 8 + length
    entries: dict[str, HeaderEntry] = {}
    for name, entry in raw.items():
        try:
            dtype = SAFETENSORS_CODES[entry["dtype"]]
            shape = tuple(_integer(s) for s in entry["shape"])
            begin, end = (_integer(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptShard(f"bad header entry for {name!r}", url) from None
        if begin < 0 or end - begin != math.prod(shape) * ITEMSIZES[dtype] or any(s < 0 for s in shape):
            raise CorruptShard(f"{name!r}: bytes [{begin}, {end}) do not hold {list(shape)} {describe(dtype)}", url)
        entries[name] = HeaderEntry(name, dtype, shape, data_start + begin, data_start + end)
    cursor = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if entry.start < cursor:
            raise CorruptShard(f"{entry.name!r}: byte range overlaps another tensor", url)
        cursor = entry.end
    if cursor > size:
        raise IncompleteCheckpoint(f"tensors end at byte {cursor} but the file has {size}: truncated", url)
    if cursor < size:
        raise CorruptShard(f"{size - cursor} bytes after the last tensor", url)
    return Header(entries, dict(metadata), data_start, bytes(data))


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


class SafetensorsFile:
    """One safetensors file; `tensors()` maps names to lazy `StoredTensor`s (header-only read)."""

    def __init__(self, url: str, reader: RangeReader | None = None, header: Header | None = None) -> None:
        """``header``: the file's, as a check read it (`parse_header` of what it carried): not read again."""
        self.url = url
        self.reader = reader or RangeReader(url)
        header = header or read_header(self.reader)
        self.header = header
        self.metadata = header.metadata
        self._entries = header.entries
        self._tensors: dict[str, StoredTensor] = {}
        for name, entry in header.entries.items():
            stride, acc = [], 1
            for s in reversed(entry.shape):
                stride.append(acc)
                acc *= s
            ref = StorageRef(name, entry.dtype_name, math.prod(entry.shape))
            self._tensors[name] = StoredTensor(self, ref, 0, entry.shape, tuple(reversed(stride)))

    def tensors(self) -> dict[str, StoredTensor]:
        return dict(self._tensors)

    def entries(self) -> dict[str, HeaderEntry]:
        """Name -> the header's entry (dtype, shape, absolute byte range), in file order."""
        return dict(sorted(self._entries.items(), key=lambda item: item[1].start))

    def read_storage_into(self, storage: StorageRef, element_offset: int, out: torch.Tensor) -> None:
        import torch

        start = self._entries[storage.key].start + element_offset * storage.itemsize
        if out.numel():
            self.reader.read_into(start, out.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        self.reader.close()
