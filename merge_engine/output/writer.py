"""Write a whole `MergePlan` at a URL: its shard jobs on this machine's threads, then the index.

``workers`` threads are shared out between the shards: ``min(workers, shards)`` shard jobs at once,
each with ``workers // jobs`` threads on its byte ranges (`merge_engine.output.shard_ranges`: a shard's
layout is fixed by the plan, so its parts are produced in parallel and written at their places;
one job alone is `merge_engine.output.shard_job.write_shard`, read-ahead, writer and hasher threads). So a
one-shard model uses every worker. Threads, not processes: every stage leaves the GIL while it
works (file and network reads, the cast in torch, the write, sha256 over large buffers), the jobs
share the open source (its readers, its parsed pickles) instead of re-opening it per process, and
nothing is pickled; a process per job would add an interpreter and a torch import (~1.5 s,
~300 MB) per worker. Measured: ``python -m benchmarks.shard_jobs`` and docs/scaling.md.

Contract of `write_plan`:
- every shard of ``plan`` is written under ``target_url``, then the index when there are several
  shards; the returned `WrittenModel` lists (name, size) and a `ShardRecord` (with sha256) per file.
- the same plan gives the same bytes whatever ``workers``.
- the first job to fail cancels the others (they stop at their next chunk) and its error is raised
  once every job has stopped; so does an interrupt (`merge_engine.output.interrupts`: jobs not started never
  start); the caller owns cleaning the partial target (`output_target`).
- memory: a shard job alone holds `PREFETCH_CHUNKS` + `HASH_QUEUE_CHUNKS` + 3 chunks of
  ``chunk_bytes`` (`merge_engine.output.shard_job`); one on ranges, its threads x
  `shard_ranges.BUFFERS_PER_WORKER` parts of `shard_ranges.PART_BYTES` (8 MiB) plus a chunk in hand each; plus the storage
  layer's read-ahead budget for remote sources.
- ``on_bytes`` (progress) is called from the worker threads, one call at a time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import torch

from merge_engine.output import interrupts
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.output.shard_job import ShardCancelled, ShardRecord, write_index, write_shard
from merge_engine.output.shard_ranges import write_shard_ranges
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource

__all__ = ["WrittenModel", "default_workers", "run_jobs", "serialised", "stop_jobs", "write_plan"]

T = TypeVar("T")


@dataclass(frozen=True)
class WrittenModel:
    """What the writer produced: file names (relative to the target) with their sizes, and their records."""

    files: tuple[tuple[str, int], ...]
    tensor_bytes: int
    records: tuple[ShardRecord, ...] = ()


def default_workers(shards: int) -> int:
    """One job per core, never more jobs than ``shards`` (file jobs that cannot be cut), at least one."""
    return max(1, min(os.cpu_count() or 1, shards))


def serialised(callback: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """``callback`` behind a lock, for progress calls from several worker threads."""
    if callback is None:
        return None
    lock = threading.Lock()

    def call(nbytes: int) -> None:
        with lock:
            callback(nbytes)

    return call


def write_plan(plan: MergePlan, source: TensorSource, target_url: str, *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_bytes: Callable[[int], None] | None = None,
               metadata: dict[str, str] | None = None, workers: int | None = 1) -> WrittenModel:
    """Write every shard of ``plan`` under ``target_url``, then the index (see the module docstring).

    ``workers``: threads in all (None: one per core), shared out between shard jobs and their ranges."""
    workers = (os.cpu_count() or 1) if workers is None else max(1, workers)
    jobs = max(1, min(workers, len(plan.shards)))
    per_shard = workers // jobs
    progress = serialised(on_bytes) if workers > 1 else on_bytes
    cancel = interrupts.cancel_event()

    def job(shard_index: int) -> ShardRecord:
        if per_shard > 1:
            return write_shard_ranges(plan, plan.shards[shard_index], source, target_url, workers=per_shard,
                                      chunk_bytes=chunk_bytes, on_bytes=progress, metadata=metadata, cancel=cancel)
        return write_shard(plan, plan.shards[shard_index], source, target_url, chunk_bytes=chunk_bytes,
                           on_bytes=progress, metadata=metadata, cancel=cancel)

    with _single_intra_op_thread():
        if jobs == 1:
            records = [job(i) for i in range(len(plan.shards))]
        else:
            records = run_jobs(job, len(plan.shards), jobs, cancel, stopped=ShardCancelled,
                               name="stepmerge-shard")
    index = write_index(plan, target_url)
    if index is not None:
        records.append(index)
    return WrittenModel(tuple((r.file, r.size) for r in records), plan.total_size, tuple(records))


def run_jobs(job: Callable[[int], T], count: int, workers: int, cancel: threading.Event, *,
             stopped: type[BaseException], name: str) -> list[T]:
    """``job(0..count-1)`` on ``workers`` threads; their results in order.

    The first failure, or an interrupt (`merge_engine.output.interrupts`: a signal, or a `KeyboardInterrupt`
    raised in this thread), sets ``cancel`` and stops the rest: jobs not started never start, running
    ones stop at their next check (raising ``stopped``). Only once every job has stopped is the
    failure raised (an interrupt: `Interrupted` / the `KeyboardInterrupt`), so nothing a job writes
    outlives the call."""
    with ThreadPoolExecutor(min(workers, count), thread_name_prefix=name) as pool:
        futures: list[Future] = []
        try:
            for i in range(count):
                futures.append(pool.submit(job, i))
            wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # interrupted while waiting: stop every job before it propagates
            stop_jobs(futures, cancel)
            raise
        if any(_failed(f) for f in futures):
            stop_jobs(futures, cancel)
            interrupts.check()  # jobs stopped by an interrupt: the interrupt is what is reported
            failures = [f for f in futures if _failed(f)]
            failed = next((f for f in failures if not isinstance(f.exception(), stopped)), failures[0])
            raise failed.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def _failed(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


def stop_jobs(futures: list[Future], cancel: threading.Event) -> None:
    """Set ``cancel``, drop the jobs not started, and wait until the running ones have stopped (a second
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
