"""torch.distributed.checkpoint (DCP) folders written without a process group or a GPU.

`DcpDataFile` (one per job): items are appended to a data file, each tensor chunk as its own ``torch.save``
archive, hashed as written; then `dcp_metadata_bytes` of all their items: ``.metadata``, written last with
torch's own record classes, so ``torch.distributed.checkpoint`` and megatron-core load the result.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.formats.dcp_file_names import DATA_FILE

if TYPE_CHECKING:  # the writer imports torch when it writes
    import torch



@dataclass(frozen=True)
class DcpItem:
    """One item of a data file, as ``.metadata`` records it: a tensor chunk (``key``, its ``offsets`` in
    the global tensor, the global ``shape``, ``dtype`` and the chunk's ``sizes``) or a bytes entry
    (``offsets`` None), and where its bytes are (``file``, ``offset``, ``length``). Small, picklable:
    what a worker that wrote a data file hands back to the one that writes ``.metadata``."""

    key: str
    offsets: tuple[int, ...] | None
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    sizes: tuple[int, ...] | None
    file: str
    offset: int
    length: int


class DcpDataFile(storage.CommitOnExit):
    """One data file of a DCP folder, items appended (`add_chunk`, `add_object`), hashed as written.

    ``close()`` commits the file; ``items`` then lists what it holds (for `dcp_metadata_bytes`),
    ``size`` and ``sha256()`` describe it. Leaving a ``with`` block by an exception (or ``abort()``)
    leaves no file. Memory: one chunk's archive at a time.
    """

    def __init__(self, url: str, name: str = DATA_FILE) -> None:
        from merge_engine.storage.hashing_writer import HashingWriter

        self.name = name
        self._out = HashingWriter(storage.join(url, name))
        self.items: list[DcpItem] = []

    @property
    def size(self) -> int:
        return self._out.size

    def sha256(self) -> str:
        return self._out.sha256()

    def add_chunk(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], tensor: torch.Tensor) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save(tensor.detach().contiguous().clone(), buffer)
        at = self._out.size
        self._out.write(buffer.getbuffer())
        self.items.append(DcpItem(key, tuple(int(o) for o in offsets), tuple(int(s) for s in global_shape),
                                  tensor.dtype, tuple(tensor.shape), self.name, at, self._out.size - at))

    def add_object(self, key: str, data: bytes) -> None:
        at = self._out.size
        self._out.write(data)
        self.items.append(DcpItem(key, None, None, None, None, self.name, at, len(data)))

    def close(self) -> None:
        self._out.close()

    def abort(self) -> None:
        self._out.abort()


def dcp_metadata_bytes(items: Iterable[DcpItem]) -> bytes:
    """``.metadata`` (torch's own record classes, pickled) for ``items`` of any data files, in their order.

    Raises `ValueError` when two chunks of one key disagree on the global shape or dtype."""
    import torch

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    items = list(items)
    state: dict[str, Any] = {}
    storage_data = {}
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[DcpItem]]] = {}
    for item in items:
        index = MetadataIndex(item.key, torch.Size(item.offsets) if item.offsets is not None else None)
        storage_data[index] = _StorageInfo(item.file, item.offset, item.length)
        if item.offsets is None:
            state[item.key] = BytesStorageMetadata()
            continue
        assert item.shape is not None and item.dtype is not None  # a tensor's chunk has both
        entry = tensors.setdefault(item.key, (item.shape, item.dtype, []))
        if entry[0] != item.shape or entry[1] != item.dtype:
            raise ValueError(f"{item.key}: chunks disagree on global shape or dtype")
        entry[2].append(item)
    for key, (shape, dtype, chunks) in tensors.items():
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets or ()), sizes=torch.Size(c.sizes or ())) for c in chunks])
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage_data))
