"""`ReadAhead`: many ranged GETs in flight for a remote file read front to back in pieces of any size.

It does for a remote file what the kernel's read-ahead does for a local one (why: docs/scaling.md):
once a stream of reads moves forward (each read starts at, or a little after, where the last one ended), the
bytes ahead are fetched in parts of `part_bytes` (at most `tuning.READ_PART_BYTES`), up to
`tuning.REQUESTS_IN_FLIGHT` parts per stream, concurrently, by the caller's ``fetch`` (the
filesystem's event loop). A stream holds ahead at most twice what it has read forward so far (one
part at least), so a reader that jumps around (a zip directory, a pickle) fetches little it does
not use, and one that streams gigabytes soon has every request in flight.

Contract:
- ``read(offset, out)`` fills a prefix of ``out`` from a window and returns how many bytes (> 0),
  or 0 when no window serves ``offset`` (the first read of a stream, a jump, no budget left): the
  caller then reads the range itself, and the stream expects its next read at the range's end.
- Several streams per file (`STREAMS`: shard jobs read one source file at different places); a
  read joins the stream whose window holds it or that expects it, else starts a new one (the least
  recently used stream is dropped).
- Memory: the parts held by every window of the process are at most `tuning.READ_AHEAD_BUDGET`
  bytes (one process-wide budget; a part that does not fit is not fetched ahead), shared equally
  between the streams holding parts; a stream not read for `STALE_READS` reads gives its parts to
  one that needs them (a reader that moved on, or was never closed, cannot starve the others).
- Faults: when a part's fetch failed, came back short or was cancelled, the bytes a read wants
  from it are read again by ``fetch_again(start, end)`` (the caller's retried read, which names a
  truncated file); a part fetched ahead but never read never raises.
- Thread-safe; `close()` cancels what is in flight and returns the budget. A window collected without
  `close()` hands its parts to the budget, which gives them back at its next locked step: a collection
  may run inside this very thread's locked section, so a finalizer never takes the lock.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from merge_engine.storage import tuning
from merge_engine.storage.body import Body, copy_range, is_body

__all__ = ["STREAMS", "ReadAhead", "part_bytes"]

STREAMS = 8  # read positions followed per file (a few shard jobs, plus a jump or two)
FORWARD_GAP = 4096  # a read this far past the stream's last one still continues it (zip record headers)
MIN_PART_BYTES = 1024 * 1024
STALE_READS = 256  # reads (process-wide) after which a stream not read since may lose its parts to another


def part_bytes() -> int:
    """Bytes per ranged GET: `tuning.READ_PART_BYTES`, smaller when the requests in flight would not fit
    the budget (never under `MIN_PART_BYTES`)."""
    in_flight = max(1, tuning.REQUESTS_IN_FLIGHT)
    return max(MIN_PART_BYTES, min(tuning.READ_PART_BYTES, tuning.READ_AHEAD_BUDGET // in_flight))


class _Budget:
    """What every window of the process shares, under one lock: the bytes held, the streams holding
    them, a clock of reads, and the open windows (to take parts back from a stream left idle)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used = 0
        self.holders = 0
        self.clock = 0
        self.windows: weakref.WeakSet[ReadAhead] = weakref.WeakSet()
        self.orphans: deque[list[_Stream]] = deque()  # streams of windows collected unclosed

    def reap(self) -> None:
        """Give back the parts of windows collected without `ReadAhead.close` (the lock held)."""
        while self.orphans:
            for stream in self.orphans.popleft():
                ReadAhead.drop_all(stream)

    def share(self, part: int) -> int:
        """Parts one stream may hold: an equal share of the budget between the streams holding parts
        (one stream racing ahead would leave the others none, and their reads unserved)."""
        return max(1, tuning.READ_AHEAD_BUDGET // part // max(1, self.holders))

    def take(self, n: int, taker: _Stream) -> bool:
        """Reserve ``n`` bytes (the lock held), taking parts back from the stream idle longest if the
        budget is spent and some stream has not been read for `STALE_READS` reads (a reader that
        moved on, or was never closed)."""
        while self.used + n > tuning.READ_AHEAD_BUDGET:
            idle = [(s.used, window, s) for window in list(self.windows) for s in window.streams
                    if s.parts and s is not taker and self.clock - s.used > STALE_READS]
            if not idle:
                return False
            _, window, stream = min(idle, key=lambda item: item[0])
            window.drop_all(stream)
        self.used += n
        return True


_BUDGET = _Budget()


@dataclass
class _Part:
    start: int
    end: int
    future: Future


@dataclass(eq=False)
class _Stream:
    expected: int  # where the next forward read starts (the end of the last one)
    run: int = 0  # bytes read forward in this stream so far
    parts: deque[_Part] = field(default_factory=deque)
    used: int = 0  # the budget's clock at its last read, for taking back the parts of an idle stream
    holding: bool = False  # counted in the budget's holders

    def holds(self, offset: int) -> bool:
        return bool(self.parts) and self.parts[0].start <= offset < self.parts[-1].end

    def continues(self, offset: int) -> bool:
        return self.expected <= offset <= self.expected + FORWARD_GAP


class ReadAhead:
    """Read-ahead windows over one remote file of ``size`` bytes (see the module docstring).

    ``fetch(start, end)`` starts a ranged GET and returns a future of its bytes (`bytes`, `bytearray` or a
    `body.Body`); ``fetch_again(start, end)`` reads a range at once, with retries, raising the storage layer's errors."""

    def __init__(self, size: int, fetch: Callable[[int, int], Future],
                 fetch_again: Callable[[int, int], bytes | Body]) -> None:
        self.size = size
        self._fetch = fetch
        self._fetch_again = fetch_again
        self.streams: list[_Stream] = []
        self._closed = False
        with _BUDGET.lock:
            _BUDGET.windows.add(self)

    def read(self, offset: int, out: memoryview) -> int:
        end = min(offset + len(out), self.size)
        with _BUDGET.lock:
            _BUDGET.reap()
            serving = self._plan_read(offset, end)
        filled = 0
        for part in serving:
            lo, hi = max(offset, part.start), min(end, part.end)
            data = self._result(part)
            if data is None:  # failed, cancelled or short: this read's bytes alone, read again
                data, lo_in, hi_in = self._fetch_again(lo, hi), 0, hi - lo
            else:
                lo_in, hi_in = lo - part.start, hi - part.start
            copy_range(data, lo_in, hi_in, out[filled:filled + hi - lo])
            filled += hi - lo
        return filled

    def _plan_read(self, offset: int, end: int) -> list[_Part]:
        """Under the budget's lock: the stream of this read, its window topped up, the parts serving it."""
        _BUDGET.clock += 1
        stream = next((s for s in self.streams if s.holds(offset)), None) or \
            next((s for s in self.streams if s.continues(offset)), None)
        if stream is None or self._closed:
            self._start_stream(end)
            return []
        stream.used = _BUDGET.clock
        while stream.parts and stream.parts[0].end <= offset:
            self._drop(stream.parts.popleft())
        if stream.parts and stream.parts[0].start > offset:  # a forward gap past the window's start
            self.drop_all(stream)
        stream.run += end - offset
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
        self._account(stream, True)
        # ahead: twice what the stream has read forward so far, in parts, up to the requests in flight
        depth = min(max(1, tuning.REQUESTS_IN_FLIGHT), max(1, -(-2 * stream.run // size)))
        limit = min(depth, _BUDGET.share(size))
        while len(stream.parts) < limit and start < self.size:
            stop = min(start + size, self.size)
            if not _BUDGET.take(stop - start, stream):
                break
            try:
                future = self._fetch(start, stop)
            except BaseException:
                _BUDGET.used -= stop - start
                raise
            stream.parts.append(_Part(start, stop, future))
            start = stop
        self._account(stream, bool(stream.parts))

    @staticmethod
    def _account(stream: _Stream, holding: bool) -> None:
        if holding != stream.holding:
            _BUDGET.holders += 1 if holding else -1
            stream.holding = holding

    def _start_stream(self, expected: int) -> None:
        if self._closed:
            return
        if len(self.streams) >= STREAMS:
            oldest = min(self.streams, key=lambda s: s.used)
            self.drop_all(oldest)
            self.streams.remove(oldest)
        self.streams.append(_Stream(expected=expected, used=_BUDGET.clock))  # read by the caller: no run yet

    @staticmethod
    def _drop(part: _Part) -> None:
        part.future.cancel()
        _BUDGET.used -= part.end - part.start

    @staticmethod
    def drop_all(stream: _Stream) -> None:
        """Give back every part of ``stream`` (the budget's lock held)."""
        while stream.parts:
            ReadAhead._drop(stream.parts.popleft())
        ReadAhead._account(stream, False)

    @staticmethod
    def _result(part: _Part) -> bytes | bytearray | Body | None:
        """The part's bytes, or None when its fetch failed, was cancelled or came back short."""
        try:
            data = part.future.result()
        except BaseException:  # noqa: BLE001 - read again by the caller, with its retries and errors
            return None
        if not is_body(data) or len(data) != part.end - part.start:
            return None
        return data

    def close(self) -> None:
        with _BUDGET.lock:
            _BUDGET.reap()
            self._closed = True
            for stream in self.streams:
                self.drop_all(stream)
            self.streams.clear()
            _BUDGET.windows.discard(self)

    def __del__(self) -> None:
        # a reader never closed gives its budget back when it goes, through the budget's next locked step:
        # never the lock here (a collection can run inside a locked section of this thread: a deadlock)
        if not getattr(self, "_closed", True):
            self._closed = True
            _BUDGET.orphans.append(self.streams)
