"""`ReadAhead`: many ranged GETs in flight for a remote file read front to back in pieces of any size.

A merge reads each source file front to back, interleaved with its other files, in pieces of every
size: a 30-byte zip header, a 3 KB norm weight, a 16 MiB chunk of an embedding. Against object
storage each piece read alone pays a request's round trip, and a chunk cut into many small parts
pays a request (and its CPU: signing, parsing) per part, so more requests in flight meant more,
smaller requests. `ReadAhead` gives a remote file what the kernel gives a local one: once a stream
of reads moves forward (each read starts at, or a little after, where the last one ended), the
bytes ahead are fetched in parts of `part_bytes` (at most `tuning.READ_PART_BYTES`), up to
`tuning.REQUESTS_IN_FLIGHT` parts per stream, concurrently, by the caller's ``fetch`` (the
filesystem's event loop). A stream's window doubles with every forward read (1, 2, 4, ... parts),
so a reader that jumps around (a zip directory, a pickle) fetches little it does not use.

Contract:
- ``read(offset, out)`` fills a prefix of ``out`` from a window and returns how many bytes (> 0),
  or 0 when no window serves ``offset`` (the first read of a stream, a jump, no budget left): the
  caller then reads the range itself, and the stream expects its next read at the range's end.
- Several streams per file (`STREAMS`: shard jobs read one source file at different places); a
  read joins the stream whose window holds it or that expects it, else starts a new one (the least
  recently used stream is dropped).
- Memory: the parts held by every window of the process are at most `tuning.READ_AHEAD_BUDGET`
  bytes (one process-wide budget; a part that does not fit is not fetched ahead).
- Faults: when a part's fetch failed, came back short or was cancelled, the bytes a read wants
  from it are read again by ``fetch_again(start, end)`` (the caller's retried read, which names a
  truncated file); a part fetched ahead but never read never raises.
- Thread-safe; `close()` cancels what is in flight and returns the budget.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from merge_engine.storage import tuning

__all__ = ["STREAMS", "ReadAhead", "budget_in_use", "part_bytes"]

STREAMS = 8  # read positions followed per file (a few shard jobs, plus a jump or two)
FORWARD_GAP = 4096  # a read this far past the stream's last one still continues it (zip record headers)
MIN_PART_BYTES = 1024 * 1024


def part_bytes() -> int:
    """Bytes per ranged GET: `tuning.READ_PART_BYTES`, smaller when the requests in flight would not fit
    the budget (never under `MIN_PART_BYTES`)."""
    in_flight = max(1, tuning.REQUESTS_IN_FLIGHT)
    return max(MIN_PART_BYTES, min(tuning.READ_PART_BYTES, tuning.READ_AHEAD_BUDGET // in_flight))


class _Budget:
    """The process-wide count of read-ahead bytes held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used = 0

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > tuning.READ_AHEAD_BUDGET:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


_BUDGET = _Budget()


def budget_in_use() -> int:
    """Read-ahead bytes held now by every window of this process (tests: 0 once readers are closed)."""
    return _BUDGET.used


@dataclass
class _Part:
    start: int
    end: int
    future: Future


@dataclass
class _Stream:
    expected: int  # where the next forward read starts (the end of the last one)
    depth: int = 1
    parts: deque[_Part] = field(default_factory=deque)
    used: int = 0  # clock of the last read, for dropping the least recently used stream

    def holds(self, offset: int) -> bool:
        return bool(self.parts) and self.parts[0].start <= offset < self.parts[-1].end

    def continues(self, offset: int) -> bool:
        return self.expected <= offset <= self.expected + FORWARD_GAP


class ReadAhead:
    """Read-ahead windows over one remote file of ``size`` bytes (see the module docstring).

    ``fetch(start, end)`` starts a ranged GET and returns a future of its bytes;
    ``fetch_again(start, end)`` reads a range at once, with retries, raising the storage layer's errors."""

    def __init__(self, size: int, fetch: Callable[[int, int], Future],
                 fetch_again: Callable[[int, int], bytes]) -> None:
        self.size = size
        self._fetch = fetch
        self._fetch_again = fetch_again
        self._streams: list[_Stream] = []
        self._lock = threading.Lock()
        self._clock = 0
        self._closed = False

    def read(self, offset: int, out: memoryview) -> int:
        end = min(offset + len(out), self.size)
        with self._lock:
            serving = self._plan_read(offset, end)
        filled = 0
        for part in serving:
            lo, hi = max(offset, part.start), min(end, part.end)
            data = self._result(part)
            if data is None:  # failed, cancelled or short: this read's bytes alone, read again
                out[filled:filled + hi - lo] = self._fetch_again(lo, hi)
            else:
                out[filled:filled + hi - lo] = memoryview(data)[lo - part.start:hi - part.start]
            filled += hi - lo
        return filled

    def _plan_read(self, offset: int, end: int) -> list[_Part]:
        """Under the lock: the stream of this read, its window topped up, and the parts that serve it."""
        self._clock += 1
        stream = next((s for s in self._streams if s.holds(offset)), None) or \
            next((s for s in self._streams if s.continues(offset)), None)
        if stream is None or self._closed:
            self._start_stream(end)
            return []
        stream.used = self._clock
        while stream.parts and stream.parts[0].end <= offset:
            self._drop(stream.parts.popleft())
        if stream.parts and stream.parts[0].start > offset:  # a forward gap past the window's start
            self._drop_all(stream)
        stream.depth = min(max(1, tuning.REQUESTS_IN_FLIGHT), stream.depth * 2)
        self._top_up(stream, offset)
        serving = []
        for part in stream.parts:
            if part.start >= end:
                break
            serving.append(part)
        if not serving or serving[0].start > offset:
            stream.expected = end  # the caller reads the range itself
            return []
        stream.expected = min(end, serving[-1].end)
        return serving

    def _top_up(self, stream: _Stream, offset: int) -> None:
        size = part_bytes()
        start = stream.parts[-1].end if stream.parts else offset
        while len(stream.parts) < stream.depth and start < self.size:
            stop = min(start + size, self.size)
            if not _BUDGET.take(stop - start):
                break
            try:
                future = self._fetch(start, stop)
            except BaseException:
                _BUDGET.give(stop - start)
                raise
            stream.parts.append(_Part(start, stop, future))
            start = stop

    def _start_stream(self, expected: int) -> None:
        if self._closed:
            return
        if len(self._streams) >= STREAMS:
            oldest = min(self._streams, key=lambda s: s.used)
            self._drop_all(oldest)
            self._streams.remove(oldest)
        self._streams.append(_Stream(expected=expected, used=self._clock))

    def _drop(self, part: _Part) -> None:
        part.future.cancel()
        _BUDGET.give(part.end - part.start)

    def _drop_all(self, stream: _Stream) -> None:
        while stream.parts:
            self._drop(stream.parts.popleft())

    @staticmethod
    def _result(part: _Part) -> bytes | None:
        """The part's bytes, or None when its fetch failed, was cancelled or came back short."""
        try:
            data = part.future.result()
        except BaseException:  # noqa: BLE001 - read again by the caller, with its retries and errors
            return None
        if not isinstance(data, (bytes, bytearray)) or len(data) != part.end - part.start:
            return None
        return data

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for stream in self._streams:
                self._drop_all(stream)
            self._streams.clear()
