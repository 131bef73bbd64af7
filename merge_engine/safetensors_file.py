"""Read safetensors files lazily over any URL: header first, tensor bytes by ranged reads.

`SafetensorsFile(url).tensors()` parses the 8-byte length and JSON header (one small read) and
returns `StoredTensor`s — the same lazy handle torch archives give — so every reader downstream
(assemblies, planner, writer) treats both formats alike.
"""

from __future__ import annotations

import json
import struct

import torch

from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.storage import RangeReader
from merge_engine.torch_archive import StorageRef, StoredTensor

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One safetensors file; `tensors()` maps names to lazy `StoredTensor`s (header-only read)."""

    def __init__(self, url: str, reader: RangeReader | None = None) -> None:
        self.url = url
        self.reader = reader or RangeReader(url)
        if self.reader.size < 8:
            raise IncompleteCheckpoint(f"safetensors file of {self.reader.size} bytes: empty or truncated", url)
        (length,) = struct.unpack("<Q", self.reader.read(0, 8))
        if length > min(MAX_HEADER, self.reader.size - 8):
            raise CorruptShard(f"safetensors header length {length} impossible for a {self.reader.size}-byte file",
                               url)
        try:
            header = json.loads(self.reader.read(8, length))
        except ValueError as exc:
            raise CorruptShard(f"safetensors header is not JSON ({exc})", url) from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + length
        self._tensors: dict[str, StoredTensor] = {}
        self._offsets: dict[str, int] = {}
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CorruptShard(f"bad header entry for {name!r}", url) from None
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtype.itemsize:
                raise CorruptShard(f"{name!r}: {end - begin} bytes for shape {shape} {dtype}", url)
            if self._data_start + end > self.reader.size:
                raise IncompleteCheckpoint(f"{name!r} runs past the end of the file: truncated", url)
            stride = []
            acc = 1
            for s in reversed(shape):
                stride.append(acc)
                acc *= s
            ref = StorageRef(name, dtype, numel)
            self._tensors[name] = StoredTensor(self, ref, 0, shape, tuple(reversed(stride)))
            self._offsets[name] = begin

    def tensors(self) -> dict[str, StoredTensor]:
        return dict(self._tensors)

    def read_storage_into(self, storage: StorageRef, element_offset: int, out: torch.Tensor) -> None:
        start = self._data_start + self._offsets[storage.key] + element_offset * storage.dtype.itemsize
        if out.numel():
            self.reader.read_into(start, memoryview(out.reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self.reader.close()
