"""One output shard cut into byte ranges written in parallel: every core on one shard.

A shard's layout is fixed by the plan before a byte is read (`shard_job.shard_header`, then the
planned tensors in order), so its bytes can be produced anywhere, in any order. They are cut into
parts of ``part_bytes`` (the store decides the exact size, `storage.open_parts`: a multiple of
O_DIRECT's block locally, at least 5 MiB and at most 10,000 parts on S3), and the parts into
ranges, the unit a worker takes: one part each, except where a part boundary falls inside a tensor
that cannot be produced from the middle (a builder without ``chunks_range``, a source without a
ranged read for it): such a tensor is produced whole by one range.

Contract of `write_shard_ranges` (same file, same bytes and record as `shard_job.write_shard`):
- ``workers`` threads take ranges in file order. Each produces its range front to back: the planned
  tensors' flat chunks (a ranged read or ``chunks_range`` for a tensor cut by the range), cast to
  the planned dtype straight into a part buffer; a full part is written at its place (local:
  ``pwrite`` into one preallocated temp file, O_DIRECT; S3: UploadPart by number) and handed on.
- the calling thread is the ordered consumer: it hashes the parts in file order as they complete
  (sha256 cannot be computed out of order) and hands each buffer back. On a store that takes a
  file's bytes only in order (GCS, ``memory://``) it also writes them, in order, through
  `storage.open_write`: the reads and casts still run on every worker, and the upload stays one
  atomic upload (why not GCS compose: docs/scaling.md).
- memory: each worker owns at most `BUFFERS_PER_WORKER` part buffers (one being filled, the others
  written and waiting to be hashed), plus the chunk in hand (at most ``chunk_bytes`` read, and its
  cast); a worker ahead of the hash waits for its buffers. So at most ``workers`` x
  `BUFFERS_PER_WORKER` x ``part_bytes``, never a tensor or a shard.
- the first failure (a source or storage fault, a wrong byte count: `CorruptShard`) stops the rest:
  ranges not started never start, running ones stop at their next chunk or part; the upload is
  discarded (no file under the shard's name, no part stays stored); the error is raised once every
  worker has stopped. ``cancel`` (another shard failed, an interrupt) does the same with
  `WriteCancelled`. ``verify_reads`` (zip CRC-32) runs after the last range, before the commit.
- `GAUGE`: ranges in flight now and at most, process-wide (what tests and benchmarks observe).
"""

from __future__ import annotations

import bisect
import hashlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch

from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor, RangedTensorBuilder, ShardFile
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.output.shard_job import shard_header, write_shard
from merge_engine.formats.tensor_source import TensorSource, iter_flat_range

__all__ = ["BUFFERS_PER_WORKER", "GAUGE", "PART_BYTES", "RangeGauge", "cut_ranges", "rangeable",
           "write_shard_ranges"]

PART_BYTES = 8 * 1024 * 1024  # >= S3's 5 MiB; 2 per worker: 16 MiB of buffers a worker
BUFFERS_PER_WORKER = 2
_POLL_S = 0.1  # how often a waiting thread looks at the stop flags


class RangeGauge:
    """Ranges in flight now (``in_flight``), at most (``peak``), and started (``started``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = self.peak = self.started = 0

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.started += 1
            self.peak = max(self.peak, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


GAUGE = RangeGauge()


@dataclass(frozen=True)
class _Span:
    """One planned tensor's bytes in the file: ``[start, end)``."""

    start: int
    end: int
    tensor: PlannedTensor
    whole_only: bool  # cannot be produced from the middle


def rangeable(tensor: PlannedTensor, source: TensorSource) -> bool:
    """Whether a byte range of ``tensor`` can be produced without producing what precedes it: a
    builder with ``chunks_range``, or a copy from a source with a ranged read of that tensor."""
    if tensor.build is not None:
        return hasattr(tensor.build, "chunks_range")
    check = getattr(source, "can_read_range", None)
    if check is not None:
        return bool(check(tensor.source_name))
    return hasattr(source, "iter_range")


def _spans(plan: MergePlan, shard: ShardFile, source: TensorSource, header_len: int) -> list[_Span]:
    by_name = plan.by_name()
    spans, at = [], header_len
    for name in shard.tensors:
        tensor = by_name[name]
        spans.append(_Span(at, at + tensor.nbytes, tensor, not rangeable(tensor, source)))
        at += tensor.nbytes
    return spans


def cut_ranges(spans: list[_Span], size: int, part_bytes: int) -> list[tuple[int, int]]:
    """Ranges as (first part, end part): one part each, merged across any part boundary that falls
    strictly inside a tensor produced whole."""
    parts = max(1, -(-size // part_bytes))
    starts = [s.start for s in spans]
    cuts = [0]
    for k in range(1, parts):
        x = k * part_bytes
        i = bisect.bisect_right(starts, x) - 1
        if i >= 0 and spans[i].whole_only and spans[i].start < x < spans[i].end:
            continue
        cuts.append(k)
    cuts.append(parts)
    return list(zip(cuts[:-1], cuts[1:]))


class _Stop(Exception):
    """Raised inside a worker once the shard is stopping (a failure elsewhere, or ``cancel``)."""


@dataclass
class _Part:
    index: int
    buffer: Any
    length: int
    home: queue.Queue  # the worker's free buffers: the consumer hands the buffer back here


class _Shard:
    """The shared state of one shard being written by ranges (see the module docstring)."""

    def __init__(self, plan: MergePlan, shard: ShardFile, source: TensorSource, url: str, header: bytes,
                 chunk_bytes: int, upload: Any, part_bytes: int, cancel: threading.Event | None) -> None:
        self.shard = shard
        self.source = source
        self.url = url
        self.header = header
        self.size = len(header) + shard.size
        self.chunk_bytes = chunk_bytes
        self.upload = upload
        self.part_bytes = part_bytes
        self.cancel = cancel
        self.spans = _spans(plan, shard, source, len(header))
        self.ranges = cut_ranges(self.spans, self.size, part_bytes)
        self.parts = self.ranges[-1][1]
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._ready: dict[int, _Part] = {}
        self._cond = threading.Condition()
        self._next = 0
        self._next_lock = threading.Lock()

    # -- shared flags
    def stopping(self) -> bool:
        return self.stop.is_set() or (self.cancel is not None and self.cancel.is_set())

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.errors.append(exc)
            self.stop.set()
            self._cond.notify_all()

    def take_range(self) -> tuple[int, int] | None:
        with self._next_lock:
            if self._next >= len(self.ranges) or self.stopping():
                return None
            self._next += 1
            return self.ranges[self._next - 1]

    def deliver(self, part: _Part) -> None:
        with self._cond:
            self._ready[part.index] = part
            self._cond.notify_all()

    def wait_part(self, index: int) -> _Part:
        with self._cond:
            while index not in self._ready:
                if self.stopping():
                    raise _Stop()
                self._cond.wait(_POLL_S)
            return self._ready.pop(index)

    def part_length(self, index: int) -> int:
        return min(self.part_bytes, self.size - index * self.part_bytes)

    # -- a worker
    def work(self) -> None:
        """One worker: ranges in file order until none is left or the shard stops. A failure is recorded
        (which stops the others) before its range leaves `GAUGE`."""
        free: queue.Queue = queue.Queue()
        made = 0
        while (taken := self.take_range()) is not None:
            GAUGE.enter()
            try:
                writer = _RangeWriter(self, taken, free, made)
                writer.run()
                made = writer.made
            except _Stop:
                return
            except BaseException as exc:  # handed to the consumer, which stops the others
                self.fail(exc)
                return
            finally:
                GAUGE.leave()

    # -- what a range holds
    def pieces(self, start: int, end: int) -> Iterator[tuple[_Span | None, int, int]]:
        """(span, lo, hi) for the bytes ``[start, end)`` of the file: the header (span None, file
        offsets) then each tensor's bytes ``[lo, hi)`` counted from the tensor's start."""
        if start < len(self.header):
            yield None, start, min(end, len(self.header))
        starts = [s.start for s in self.spans]
        i = max(0, bisect.bisect_right(starts, start) - 1)
        for span in self.spans[i:]:
            if span.start >= end:
                break
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                yield span, lo - span.start, hi - span.start


class _RangeWriter:
    """Produces the bytes of one range into part buffers, writes and delivers each full part."""

    def __init__(self, shard: _Shard, taken: tuple[int, int], free: queue.Queue, made: int) -> None:
        self.s = shard
        self.first, self.end = taken
        self.free = free
        self.made = made
        self.index = self.first
        self.buffer: Any = None
        self.bytes_view: torch.Tensor | None = None
        self.fill = 0
        self.length = 0

    def _acquire(self) -> None:
        s = self.s
        self.length = s.part_length(self.index)
        while True:
            try:
                self.buffer = self.free.get_nowait()
                break
            except queue.Empty:
                pass
            if self.made < BUFFERS_PER_WORKER:
                self.made += 1
                self.buffer = s.upload.buffer(s.part_bytes) if s.upload is not None else bytearray(s.part_bytes)
                break
            try:
                self.buffer = self.free.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if s.stopping():
                    raise _Stop() from None
        self.bytes_view = torch.frombuffer(self.buffer, dtype=torch.uint8, count=s.part_bytes)
        self.fill = 0

    def _flush(self) -> None:
        s = self.s
        if s.stopping():
            raise _Stop()
        view = memoryview(self.buffer)[:self.length]
        if s.upload is not None:
            s.upload.write_part(self.index, view)
        s.deliver(_Part(self.index, self.buffer, self.length, self.free))
        self.buffer = self.bytes_view = None
        self.index += 1

    def _room(self) -> int:
        if self.buffer is None:
            self._acquire()
        return self.length - self.fill

    def put_bytes(self, data: torch.Tensor) -> None:
        """Copy a flat uint8 tensor into the parts (torch's copy leaves the GIL)."""
        while data.numel():
            n = min(data.numel(), self._room())
            assert self.bytes_view is not None  # a part was acquired by _room
            self.bytes_view[self.fill:self.fill + n].copy_(data[:n])
            self.fill += n
            data = data[n:]
            if self.fill == self.length:
                self._flush()

    def put_values(self, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Cast a flat chunk to ``dtype`` straight into the parts (aligned: the caller checked)."""
        size = dtype.itemsize
        while values.numel():
            room = self._room()
            n = min(values.numel(), room // size)
            assert self.bytes_view is not None  # a part was acquired by _room
            self.bytes_view[self.fill:self.fill + n * size].view(dtype).copy_(values[:n])
            self.fill += n * size
            values = values[n:]
            if self.fill == self.length:
                self._flush()

    def run(self) -> None:
        s = self.s
        start, end = self.first * s.part_bytes, min(self.end * s.part_bytes, s.size)
        for span, lo, hi in s.pieces(start, end):
            if span is None:
                self.put_bytes(torch.frombuffer(bytearray(s.header[lo:hi]), dtype=torch.uint8))
            else:
                self._tensor_bytes(span.tensor, span.start, lo, hi)
        if self.buffer is not None:  # never: a range ends on a part boundary (or the file's end)
            raise CorruptShard(f"{s.shard.filename}: range {self.first} ended inside part {self.index}", s.url)

    def _tensor_bytes(self, tensor: PlannedTensor, file_start: int, lo: int, hi: int) -> None:
        s = self.s
        size = tensor.dtype.itemsize
        first, last = lo // size, -(-hi // size)
        count = last - first
        if first == 0 and last * size == tensor.nbytes:
            chunks = tensor.build.chunks(s.source, s.chunk_bytes) if tensor.build is not None else \
                s.source.iter_chunks(tensor.source_name, s.chunk_bytes)
        elif tensor.build is not None:  # one with chunks_range: `_can_start_inside`
            chunks = cast(RangedTensorBuilder, tensor.build).chunks_range(s.source, first, count, s.chunk_bytes)
        else:
            chunks = iter_flat_range(s.source, tensor.source_name, first, count, s.chunk_bytes)
        # aligned: the piece starts on an element and the buffers' place for it is on one too
        aligned = lo % size == 0 and hi % size == 0 and (file_start + lo) % size == 0 and s.part_bytes % size == 0
        skip, produced = lo - first * size, 0
        for chunk in chunks:
            if s.stopping():
                raise _Stop()
            chunk = chunk.reshape(-1)
            if produced + chunk.numel() > count:
                raise CorruptShard(f"{tensor.name}: produced more than the {count} elements planned", s.source.url)
            produced += chunk.numel()
            if aligned:
                self.put_values(chunk, tensor.dtype)
                continue
            raw = chunk.to(tensor.dtype).view(torch.uint8) if chunk.numel() else torch.empty(0, dtype=torch.uint8)
            if skip:
                raw, skip = raw[skip:], max(0, skip - raw.numel())
            take = min(raw.numel(), hi - lo)
            self.put_bytes(raw[:take])
            lo += take
        if produced != count:
            raise CorruptShard(f"{tensor.name}: produced {produced * size} bytes, planned {count * size}",
                               s.source.url)


def write_shard_ranges(plan: MergePlan, shard: ShardFile, source: TensorSource, folder_url: str, *,
                       workers: int, chunk_bytes: int, part_bytes: int | None = None,
                       on_bytes: Callable[[int], None] | None = None, metadata: dict[str, str] | None = None,
                       cancel: threading.Event | None = None) -> FileRecord:
    """Write one shard of ``plan`` under ``folder_url`` with ``workers`` threads on its byte ranges (see
    the module docstring); a shard of one range is written by `shard_job.write_shard`. ``part_bytes``:
    the part size asked of the store (None: `PART_BYTES`, read at call time)."""
    part_bytes = part_bytes or PART_BYTES
    header = shard_header(plan, shard, metadata)
    size = len(header) + shard.size
    url = storage.join(folder_url, shard.filename)
    upload = storage.open_parts(url, size, part_bytes)
    state = _Shard(plan, shard, source, url, header, chunk_bytes, upload,
                   upload.part_bytes if upload is not None else part_bytes, cancel)
    if workers <= 1 or len(state.ranges) <= 1:
        if upload is not None:
            upload.discard()
        return write_shard(plan, shard, source, folder_url, chunk_bytes=chunk_bytes, on_bytes=on_bytes,
                           metadata=metadata, cancel=cancel)
    ordered = storage.open_write(url, size_hint=size) if upload is None else None
    digest = hashlib.sha256()
    threads = min(workers, len(state.ranges))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="stepmerge-range")
    committed = False
    try:
        for _ in range(threads):
            pool.submit(state.work)
        for index in range(state.parts):
            try:
                part = state.wait_part(index)
            except _Stop:
                break
            view = memoryview(part.buffer)[:part.length]
            if ordered is not None:
                ordered.write(view)
            digest.update(view)  # releases the GIL on large buffers
            part.home.put(part.buffer)
            if on_bytes:
                start = index * state.part_bytes
                on_bytes(part.length - max(0, min(len(header), start + part.length) - start))
        pool.shutdown(wait=True)
        if state.errors:
            raise _first_error(state.errors)
        if cancel is not None and cancel.is_set():
            raise WriteCancelled(shard.filename)
        verify = getattr(source, "verify_reads", None)
        if verify is not None:  # the zip CRC-32 of every record read from, before the shard counts
            verify()
        if upload is not None:
            upload.commit()
        elif ordered is not None:
            ordered.close()
        committed = True
    finally:
        if not committed:
            state.stop.set()
            _shutdown(pool)
            try:
                if upload is not None:
                    upload.discard()
                elif ordered is not None:
                    ordered.abort()
            except Exception:  # noqa: BLE001 - the error that stopped the shard is the one reported
                pass
    return FileRecord(shard.filename, size, digest.hexdigest(), shard.tensors)


def _first_error(errors: list[BaseException]) -> BaseException:
    return next((e for e in errors if not isinstance(e, WriteCancelled)), errors[0])


def _shutdown(pool: ThreadPoolExecutor) -> None:
    """Wait for every worker to stop (a second interrupt does not cut the wait short: what they write is
    discarded after them)."""
    while True:
        try:
            pool.shutdown(wait=True)
            return
        except KeyboardInterrupt:
            continue
