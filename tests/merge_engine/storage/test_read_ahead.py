"""Read-ahead of remote ranged reads (`merge_engine.storage.read_ahead`).

Specification:
- reads that move forward (small and large, with the small gaps of zip record headers) come back
  byte-exact from S3 and GCS, and are served by parts fetched ahead: far fewer GETs than reads;
- a reader that jumps around fetches nothing ahead (no GET for bytes it does not read);
- the parts held never exceed the process-wide budget, and closing a reader returns its budget; a reader
  never closed returns it when collected, even by a collection inside this thread's locked step (no deadlock);
- a part whose fetch fails is fetched again with the storage layer's retries (bytes still exact);
  a file shorter than its listing is still `IncompleteCheckpoint` when the reader reaches the gap.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import RangeReader, read_ahead
from merge_engine.storage.backend import FsspecRangedFile
from tests.fault_proxy import Fault
from tests.merge_engine.storage.patterned import patterned_bytes

SIZE = 200_000
PART = 4096


def budget_in_use() -> int:
    """Read-ahead bytes held now by every window of this process (0 once readers are closed); the parts of
    windows the garbage collector finalized are given back first, as the budget's next locked step does."""
    with read_ahead._BUDGET.lock:
        read_ahead._BUDGET.reap()
        return read_ahead._BUDGET.used


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(storage.tuning, "READ_PART_BYTES", PART)
    monkeypatch.setattr(storage.tuning, "REQUESTS_IN_FLIGHT", 8)
    monkeypatch.setattr(storage.tuning, "READ_AHEAD_BUDGET", 16 * PART)
    monkeypatch.setattr(read_ahead, "MIN_PART_BYTES", 512)


@pytest.fixture
def counted_gets(monkeypatch) -> dict[str, int]:
    """GETs issued by remote readers: parts fetched ahead and direct reads (the real calls, counted)."""
    counts = {"ahead": 0, "direct": 0}
    fetch, get = FsspecRangedFile._fetch, FsspecRangedFile._get

    def counted_fetch(self, start, end):
        counts["ahead"] += 1
        return fetch(self, start, end)

    def counted_get(self, start, end):
        counts["direct"] += 1
        return get(self, start, end)

    monkeypatch.setattr(FsspecRangedFile, "_fetch", counted_fetch)
    monkeypatch.setattr(FsspecRangedFile, "_get", counted_get)
    return counts


def forward_reads(size: int) -> list[tuple[int, int]]:
    """What a merge does to a torch.save file: a 30-byte header, a gap, data of varied sizes, again."""
    reads, at, n = [], 0, 0
    while at + 100 < size:
        length = min((17, 300, 5000, 900)[n % 4], size - at - 64)
        reads += [(at, 30), (at + 64, length)]
        at += 64 + length
        n += 1
    return reads


@pytest.fixture(params=["s3", "gs"])
def remote_root(request) -> str:
    return request.getfixturevalue("s3_bucket_url" if request.param == "s3" else "gcs_bucket_url") + "/ahead"


def test_forward_reads_are_exact_and_served_ahead(remote_root, small_parts, counted_gets):
    data = patterned_bytes(SIZE, seed=5)
    url = storage.join(remote_root, "rank_0.pt")
    storage.write_bytes(url, data)
    reads = forward_reads(SIZE)
    with RangeReader(url, size=SIZE) as reader:
        for offset, length in reads:
            assert reader.read(offset, length) == data[offset:offset + length], (offset, length)
        assert budget_in_use() <= storage.tuning.READ_AHEAD_BUDGET
    assert budget_in_use() == 0
    gets = counted_gets["ahead"] + counted_gets["direct"]
    assert counted_gets["ahead"] > 0 and gets <= SIZE // PART + 4 and gets < len(reads) // 4, counted_gets


def test_a_reader_that_jumps_fetches_nothing_ahead(s3_bucket_url, small_parts, counted_gets):
    data = patterned_bytes(SIZE, seed=6)
    url = storage.join(s3_bucket_url, "jumps.bin")
    storage.write_bytes(url, data)
    offsets = [150_000, 10_000, 190_000, 70_000, 120_000, 0]
    with RangeReader(url, size=SIZE) as reader:
        for offset in offsets:
            assert reader.read(offset, 100) == data[offset:offset + 100]
    assert counted_gets == {"ahead": 0, "direct": len(offsets)}


def test_a_failed_part_is_fetched_again(s3_fault_proxy, s3_bucket_url, small_parts):
    """A connection reset while parts are in flight: the reads still return the exact bytes."""
    data = patterned_bytes(SIZE, seed=7)
    url = storage.join(s3_bucket_url, "reset.bin")
    storage.write_bytes(url, data)
    with RangeReader(url, size=SIZE) as reader:
        assert reader.read(0, 1000) == data[:1000]
        s3_fault_proxy.set_fault(Fault.reset(after_bytes=PART // 2, connections=3))
        for offset in range(1000, SIZE - 5000, 5000):
            assert reader.read(offset, 5000) == data[offset:offset + 5000]
    assert s3_fault_proxy.fired >= 1


def test_a_file_shorter_than_its_listing_fails_when_the_reader_reaches_the_gap(s3_bucket_url, small_parts):
    url = storage.join(s3_bucket_url, "short.bin")
    storage.write_bytes(url, patterned_bytes(SIZE // 2))
    with RangeReader(url, size=SIZE) as reader:
        for offset in range(0, SIZE // 2 - 1000, 1000):
            reader.read(offset, 1000)  # before the gap: fine, though parts past the real end fail
        with pytest.raises(IncompleteCheckpoint) as info:
            for offset in range(SIZE // 2 - 1000, SIZE, 1000):
                reader.read(offset, 1000)
        assert info.value.path == url
    assert budget_in_use() == 0


class TestWindows:
    """`ReadAhead` alone, over bytes in memory fetched by a thread pool."""

    @pytest.fixture
    def source(self, small_parts):
        data = patterned_bytes(SIZE, seed=8)
        pool = ThreadPoolExecutor(4)
        log: list[tuple[int, int]] = []
        lock = threading.Lock()
        failing: set[int] = set()

        def fetch(start: int, end: int) -> Future:
            with lock:
                log.append((start, end))
            if start in failing:
                future: Future = Future()
                future.set_exception(ConnectionResetError("reset"))
                return future
            return pool.submit(lambda: data[start:end])

        def fetch_again(start: int, end: int) -> bytes:
            return data[start:end]

        yield data, read_ahead.ReadAhead(SIZE, fetch, fetch_again), log, failing
        pool.shutdown()

    def test_the_window_grows_while_reads_move_forward_and_stays_in_budget(self, source):
        data, ahead, log, _ = source
        peak = 0
        offset = 0
        assert ahead.read(0, memoryview(bytearray(100))) == 0  # a new stream: the caller reads itself
        offset = 100
        while offset < SIZE:
            out = bytearray(min(1000, SIZE - offset))
            n = ahead.read(offset, memoryview(out))
            assert n > 0 and bytes(out[:n]) == data[offset:offset + n]
            offset += n
            peak = max(peak, budget_in_use())
        assert peak <= storage.tuning.READ_AHEAD_BUDGET
        assert max(len(s.parts) for s in ahead.streams) <= storage.tuning.REQUESTS_IN_FLIGHT
        assert len(log) == -(-(SIZE - 100) // PART)  # every byte fetched once, in parts
        ahead.close()
        assert budget_in_use() == 0

    def test_two_readers_of_one_file_keep_their_own_windows(self, source):
        data, ahead, log, _ = source
        positions = [0, SIZE // 2]
        for position in positions:
            ahead.read(position, memoryview(bytearray(10)))
        positions = [10, SIZE // 2 + 10]
        for _ in range(40):
            for i, position in enumerate(positions):
                out = bytearray(500)
                n = ahead.read(position, memoryview(out))
                assert n > 0 and bytes(out[:n]) == data[position:position + n]
                positions[i] += n
        assert len(ahead.streams) == 2
        assert len(log) <= 2 * (40 * 500 // PART + storage.tuning.REQUESTS_IN_FLIGHT + 1)
        ahead.close()

    def test_a_failed_fetch_is_read_again(self, source):
        data, ahead, _, failing = source
        failing.update({100 + PART, 100 + 3 * PART})
        ahead.read(0, memoryview(bytearray(100)))
        offset = 100
        while offset < 100 + 6 * PART:
            out = bytearray(700)
            n = ahead.read(offset, memoryview(out))
            assert bytes(out[:n]) == data[offset:offset + n]
            offset += n
        ahead.close()
        assert budget_in_use() == 0

    def test_a_window_collected_inside_a_locked_step_of_this_thread_gives_its_parts_back(self, small_parts):
        """The garbage collector can finalize an unclosed window at any allocation, also while this thread
        holds the budget's lock (it did inside another window's read, comparing tensors from S3): the
        finalizer must not wait for that lock. Its parts go back at the budget's next locked step."""
        import gc

        data = patterned_bytes(SIZE, seed=9)

        def fetch(start: int, end: int) -> Future:
            future: Future = Future()
            future.set_result(data[start:end])
            return future

        ahead = read_ahead.ReadAhead(SIZE, fetch, lambda start, end: data[start:end])
        ahead.read(0, memoryview(bytearray(100)))
        ahead.read(100, memoryview(bytearray(1000)))
        assert budget_in_use() > 0
        finished = threading.Event()

        def collect_under_the_lock():
            nonlocal ahead
            with read_ahead._BUDGET.lock:
                ahead = None  # the last reference: finalized here, the lock held by this very thread
                gc.collect()
            finished.set()

        worker = threading.Thread(target=collect_under_the_lock, daemon=True)
        worker.start()
        assert finished.wait(60), "the finalizer waited for the budget's lock its own thread holds"
        assert budget_in_use() == 0
