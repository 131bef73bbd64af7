"""One output shard: ranged reads from every source file -> cast -> write -> sha256 -> a small record.

A shard is a work unit (`merge_engine.output.shard_unit.ShardUnit`). Its header is computed from the plan
before its first byte is written; its tensors' chunks are produced by a reader thread a few chunks ahead
of the writer (reads and casts release the GIL), cast to the planned dtype, written, and hashed as they
are written by the one hashing writer (`merge_engine.storage.hashing_writer.HashingWriter`, hashing in a
thread of its own), so the record's sha256 costs no second read of the model. With several threads, the
unit writes its byte ranges in parallel instead (`merge_engine.output.shard_ranges`): same file, same
bytes, same record.

Contract of `write_shard`:
- writes ``shard_header(plan, shard) + tensor bytes`` to ``<folder>/<shard.filename>`` through
  `storage.open_write`: a local temp file renamed into place at the end, a multipart upload
  completed at the end. A job that fails, is cancelled or is killed leaves no file under the shard's
  name (a killed local job may leave its temp file, which the output target discards with its temp
  folder); running it again overwrites the shard whole.
- holds at most `PREFETCH_CHUNKS` + `HASH_QUEUE_CHUNKS` + 3 chunks of ``chunk_bytes`` (read ahead,
  being written, waiting for and in the hasher), never a tensor or a shard.
- returns a `FileRecord` (file, size, sha256, tensor names): small, picklable, what a coordinator,
  a Ray task or a Prefect task hands back.
- ``cancel``: checked before every chunk; once set, the job stops with `WriteCancelled` (another unit
  of the same job failed: its error is the one reported).
- errors of the source propagate as they are (the named errors of `merge_engine.errors`); the
  source's own checksums (zip CRC-32, `TensorSource.verify_reads`) are checked in the reader thread
  before the last chunk is written, so a damaged record fails the job before its file is committed.
"""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
from collections.abc import Callable, Iterator

import torch

from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.formats.safetensors_file import CODES as SAFETENSORS_DTYPES
from merge_engine.formats.tensor_source import TensorSource
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.plan.merge_plan import INDEX_FILE, MergePlan, PlannedTensor, ShardFile
from merge_engine.storage.hashing_writer import HashingWriter

__all__ = ["HASH_QUEUE_CHUNKS", "PREFETCH_CHUNKS", "index_bytes", "shard_header", "tensor_chunks", "write_index",
           "write_shard"]

PREFETCH_CHUNKS = 3
HASH_QUEUE_CHUNKS = 2  # written chunks waiting for the hasher thread


def shard_header(plan: MergePlan, shard: ShardFile, metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of ``shard``: 8-byte length, JSON padded to 8 bytes (from the plan alone)."""
    by_name = plan.by_name()
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in shard.tensors:
        tensor = by_name[name]
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_chunks(tensor: PlannedTensor, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
    """Flat chunks of one planned tensor in its output dtype; checks the byte count at the end."""
    chunks = tensor.build.chunks(source, max_bytes) if tensor.build is not None else \
        source.iter_chunks(tensor.source_name, max_bytes)
    written = 0
    for chunk in chunks:
        chunk = chunk.reshape(-1)
        if chunk.dtype != tensor.dtype:
            chunk = chunk.to(tensor.dtype)
        written += chunk.numel() * chunk.element_size()
        yield chunk
    if written != tensor.nbytes:
        raise CorruptShard(f"{tensor.name}: produced {written} bytes, planned {tensor.nbytes}", source.url)


class _Prefetcher:
    """Runs ``items`` in a reader thread, ``depth`` items ahead; its error is re-raised in the caller.

    `close()` stops the thread and waits for it (idempotent). Every hand-over waits with a timeout
    and gives up once closed, so a consumer that stops early (an error while writing) never leaves
    the reader blocked on a full queue, and never blocks on it itself.
    """

    _DONE = object()

    def __init__(self, items: Iterator[torch.Tensor], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(items,), name="stepmerge-reader", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterator[torch.Tensor]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(self._DONE)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> torch.Tensor:
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def write_shard(plan: MergePlan, shard: ShardFile, source: TensorSource, folder_url: str, *,
                chunk_bytes: int, on_bytes: Callable[[int], None] | None = None,
                metadata: dict[str, str] | None = None,
                cancel: threading.Event | None = None) -> FileRecord:
    """Write one shard of ``plan`` under ``folder_url`` (see the module docstring)."""
    by_name = plan.by_name()
    header = shard_header(plan, shard, metadata)

    def chunks() -> Iterator[torch.Tensor]:
        for name in shard.tensors:
            yield from tensor_chunks(by_name[name], source, chunk_bytes)
        verify = getattr(source, "verify_reads", None)
        if verify is not None:  # the zip CRC-32 of every record this job read from, before the shard counts
            verify()

    remaining = shard.size
    prefetched = _Prefetcher(chunks(), PREFETCH_CHUNKS)
    try:
        with HashingWriter(storage.join(folder_url, shard.filename), size_hint=len(header) + shard.size,
                           hash_queue=HASH_QUEUE_CHUNKS) as out:
            out.write(header)
            for chunk in prefetched:
                if cancel is not None and cancel.is_set():
                    raise WriteCancelled(shard.filename)
                data = chunk.view(torch.uint8).numpy().data if chunk.numel() else memoryview(b"")
                if len(data) > remaining:
                    raise CorruptShard(f"{shard.filename}: tensor data overran the planned size", source.url)
                out.write(data)
                remaining -= len(data)
                if on_bytes:
                    on_bytes(len(data))
            if remaining != 0:
                raise CorruptShard(f"{shard.filename}: tensor data fell {remaining} bytes short of the plan",
                                   source.url)
    finally:
        prefetched.close()
    return FileRecord(shard.filename, out.size, out.sha256(), shard.tensors)


def index_bytes(plan: MergePlan) -> bytes:
    """``model.safetensors.index.json`` of a plan with several shards (from the plan alone)."""
    index = {"metadata": {"total_size": plan.total_size},
             "weight_map": {name: shard.filename for shard in plan.shards for name in shard.tensors}}
    return (json.dumps(index, indent=2) + "\n").encode()


def write_index(plan: MergePlan, folder_url: str) -> FileRecord | None:
    """Write the index under ``folder_url`` when the plan has several shards; its record, else None."""
    if len(plan.shards) <= 1:
        return None
    data = index_bytes(plan)
    storage.write_bytes(storage.join(folder_url, INDEX_FILE), data)
    return FileRecord(INDEX_FILE, len(data), hashlib.sha256(data).hexdigest())
