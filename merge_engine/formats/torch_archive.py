"""Read ``torch.save`` archives lazily and safely: structure first, bytes only on demand.

A ``torch.save`` file is an uncompressed zip holding ``<archive>/data.pkl`` (the object tree) and
one record ``<archive>/data/<key>`` per storage. `TorchArchive` parses the zip directory and the
pickle — kilobytes — and returns the object tree with every tensor replaced by a `StoredTensor`:
the file, byte offset, dtype, shape and strides of its data. Nothing of the tensors is read.

Integrity: every byte of a record read is folded into that record's CRC-32 as it is read
(`merge_engine.formats.zip_crc`); a record read whole is checked then, one read in part is completed and
checked by `TorchArchive.verify_reads`. A mismatch is `CorruptShard` naming the file and the record
(``torch.load`` checks none of this). ``data.pkl`` is read by ``zipfile``, which checks its CRC.

Safety: the pickle is read by `merge_engine.formats.safe_unpickler` (an allow-list of stand-ins: nothing it
names is run).
"""

from __future__ import annotations

import bisect
import io
import math
import struct
import zipfile
from typing import TYPE_CHECKING, Any, NamedTuple

from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafePickle
from merge_engine.formats.safe_unpickler import SafeUnpickler, check_nesting, naming_url
from merge_engine.formats.stored_tensor import StorageRef, StoredTensor
from merge_engine.formats.zip_crc import RecordChecks
from merge_engine.storage import RangeReader

if TYPE_CHECKING:  # torch is imported by the functions that read bytes into tensors, never by a check
    import torch

MAX_PICKLE_BYTES = 1 << 30  # a state dict's structure; tensors live in separate records


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
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(_ReaderFile(self.reader))
            names = self._zip.namelist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise CorruptShard(f"not a readable torch zip archive ({exc}); truncated, still being written, or not a torch file", url) from exc
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptShard("zip archive without a single data.pkl: not a torch.save file", url)
        self._prefix = pkl[0][: -len("data.pkl")]
        self._infos: dict[str, zipfile.ZipInfo | StorageRecordInfo] = {
            info.filename: info for info in self._zip.infolist()}
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
                tree = SafeUnpickler(data, self).load()
            except (UnsafePickle, CorruptShard) as exc:
                raise naming_url(exc, self.url) from None
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
            order = self._zip.read(info.filename) if self._zip is not None and info.file_size <= 16 else b""
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

    def keep_view(self, view: StoredTensor) -> None:
        """A view the pickle rebuilt on one of this archive's records (checked disjoint once `load()` is done)."""
        self._views.append(view)

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
            key: tuple[Any, ...] = () if dense else (view.shape, view.stride, size)  # dense: the byte interval is the identity
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
        data = out.reshape(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(b"")
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
