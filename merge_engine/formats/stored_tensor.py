"""A tensor as a file stores it: `StorageRef` (a storage record: key, dtype, element count) and `StoredTensor`
(a strided view on one, holding no data; read on demand through the file that owns the bytes, a
`merge_engine.formats.torch_archive.TorchArchive` or a `merge_engine.formats.safetensors_file.SafetensorsFile`);
`view_problem`, the check every view a file declares must pass (inside its storage, no element reached twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine.formats.dtype_names import DTypeByName, name_of

if TYPE_CHECKING:  # torch is imported by the functions that read bytes into tensors, never by a check
    import torch

GATHER_ELEMENTS = 1 << 20  # non-contiguous reads: flat elements located per pass
GATHER_WINDOW_BYTES = 32 << 20  # non-contiguous reads: most storage bytes held at once


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely in row-major order (size-1 dims may have any stride)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


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
