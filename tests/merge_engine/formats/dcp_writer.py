"""`DcpWriter`: a whole DCP folder from one process, for tests (the product writes `DcpDataFile`s from
several jobs, then `dcp_metadata_bytes` of all their items: `merge_engine.formats.torch_dcp_writer`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merge_engine import storage
from merge_engine.formats.dcp_file_names import DATA_FILE, METADATA_FILE
from merge_engine.formats.torch_dcp_writer import DcpDataFile, dcp_metadata_bytes


class DcpWriter:
    """Write a DCP folder: tensor chunks and bytes entries into one data file, then ``.metadata``.

    `add_chunk(key, global_shape, offsets, tensor)` appends a chunk (its own ``torch.save``
    archive); `add_object(key, data)` a bytes entry; `close()` writes ``.metadata`` last and
    returns the file names written. Memory: one chunk at a time. (A folder of several data files
    written by several jobs: `DcpDataFile` each, then `dcp_metadata_bytes` of all their items.)
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._data = DcpDataFile(url)
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def add_chunk(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], tensor: torch.Tensor) -> None:
        shape = (tuple(int(s) for s in global_shape), tensor.dtype)
        if self._shapes.setdefault(key, shape) != shape:
            raise ValueError(f"{key}: chunks disagree on global shape or dtype")
        self._data.add_chunk(key, global_shape, offsets, tensor)

    def add_object(self, key: str, data: bytes) -> None:
        self._data.add_object(key, data)

    def close(self) -> list[str]:
        self._data.close()
        storage.write_bytes(storage.join(self.url, METADATA_FILE), dcp_metadata_bytes(self._data.items))
        return [DATA_FILE, METADATA_FILE]

    def abort(self) -> None:
        self._data.abort()


def read_object(url: str, location) -> bytes:
    """The bytes of a DCP bytes entry (``index.objects[key]``, an `ItemLocation`) of the folder at ``url``: the
    product reads none (a merge needs only tensors), the tests check what the writer wrote."""
    return storage.RangeReader(storage.join(url, location.file)).read(location.offset, location.length)
