"""Work units on this machine's threads: THE pool loop ("the first failure cancels the rest").

``workers`` threads are shared out between the units: ``min(workers, units)`` units at once, each with
``workers // running`` threads on its own byte ranges (a safetensors shard: `merge_engine.output.shard_ranges`,
its layout being fixed by the plan, its parts are produced in parallel and written at their places; a
unit that cannot be cut, such as a Megatron rank file, uses one). So a one-shard model uses every worker.
Threads, not processes: every stage leaves the GIL while it works (file and network reads, the cast in
torch, the write, sha256 over large buffers), the units share the open source (its readers, its parsed
pickles) instead of re-opening it per process, and nothing is pickled; a process per unit would add an
interpreter and a torch import per worker (docs/scaling.md, ``python -m benchmarks.shard_jobs``).

Contract of `run_units`:
- every unit is written under ``folder_url``; their `FileRecord`s come back in the order of the units;
- the same units give the same bytes whatever ``workers``;
- the first unit to fail cancels the others (they stop at their next chunk with `WriteCancelled`) and its
  error is raised once every unit has stopped; so does an interrupt (`merge_engine.output.interrupts`:
  units not started never start); the caller owns cleaning the partial target (`output.target`);
- memory: a unit alone holds what its kind holds (a shard job: `shard_job.PREFETCH_CHUNKS` +
  `shard_job.HASH_QUEUE_CHUNKS` + 3 chunks of ``chunk_bytes``; one on ranges, its threads x
  `shard_ranges.BUFFERS_PER_WORKER` parts of `shard_ranges.PART_BYTES` plus a chunk in hand each; a rank
  file, its tensors), plus the storage layer's read-ahead budget for remote sources;
- ``on_bytes`` (progress) is called from the worker threads, one call at a time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch

from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.output import interrupts
from merge_engine.output.work_unit import WorkUnit

__all__ = ["run_units"]


def run_units(units: Sequence[WorkUnit], folder_url: str, *, workers: int | None = 1,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              on_bytes: Callable[[int], None] | None = None) -> list[FileRecord]:
    """Write every unit under ``folder_url`` on ``workers`` threads in all (None: one per core), shared
    out between the units and their byte ranges; their records in order (see the module docstring)."""
    workers = (os.cpu_count() or 1) if workers is None else max(1, workers)
    running = max(1, min(workers, len(units)))
    threads = workers // running
    progress = _serialised(on_bytes) if workers > 1 and on_bytes is not None else on_bytes
    cancel = interrupts.cancel_event()

    def run(position: int) -> FileRecord:
        unit = units[position]
        if cancel.is_set():  # another unit failed, or an interrupt: a unit not started never starts
            raise WriteCancelled(unit.planned[0])
        try:
            return unit.run(folder_url, cancel, chunk_bytes=chunk_bytes, threads=threads, on_bytes=progress)
        except BaseException:
            cancel.set()  # before this thread takes the next unit
            raise

    with _single_intra_op_thread():
        if running == 1:
            return [run(position) for position in range(len(units))]
        with ThreadPoolExecutor(running, thread_name_prefix="stepmerge-unit") as pool:
            futures: list[Future] = []
            try:
                for position in range(len(units)):
                    futures.append(pool.submit(run, position))
                wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # interrupted while waiting: stop every unit before it propagates
                _stop(futures, cancel)
                raise
            if any(_failed(f) for f in futures):
                _stop(futures, cancel)
                interrupts.check()  # units stopped by an interrupt: the interrupt is what is reported
                failures = [f for f in futures if _failed(f)]
                failed = next((f for f in failures if not isinstance(f.exception(), WriteCancelled)), failures[0])
                raise failed.exception()  # type: ignore[misc]
            return [f.result() for f in futures]


def _serialised(callback: Callable[[int], None]) -> Callable[[int], None] | None:
    """``callback`` behind a lock, for progress calls from several worker threads."""
    if callback is None:
        return None
    lock = threading.Lock()

    def call(nbytes: int) -> None:
        with lock:
            callback(nbytes)

    return call


def _failed(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


def _stop(futures: list[Future], cancel: threading.Event) -> None:
    """Set ``cancel``, drop the units not started, and wait until the running ones have stopped (a second
    interrupt does not cut the wait short: what they write must be cleaned up after them)."""
    cancel.set()
    for future in futures:
        future.cancel()
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue


@contextlib.contextmanager
def _single_intra_op_thread() -> Iterator[None]:
    """Casts are memory-bound: one torch thread is several GB/s, while more threads spin against the
    reader and writer threads (measured 6x slower on 2 busy cores). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
