"""One unit of work (`merge_engine.output.work_unit`), one pool loop (`merge_engine.output.writer.run_units`).

Specification:
- an executor runs any `WorkUnit` (here one that is neither a shard nor a layout's file): the units'
  records come back in unit order, ``finish`` sees them in that order, ``then`` follows, and every file
  a unit or ``finish`` wrote is listed with the sha256 of its bytes, under the output's folder;
- the same units give the same bytes on one thread or several;
- the first unit to fail stops the others through the one cancel path (`WriteCancelled` at their next
  check): its error, not the cancellation, is raised, and only once every unit has stopped; units not
  started never start;
- a safetensors shard and a ``split`` rank file are both work units with the same record type.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from merge_engine import storage
from merge_engine.errors import CorruptShard
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.output.writer import run_units
from merge_engine.storage.hashing_writer import HashingWriter


class _Repeated:
    """A unit that writes ``count`` copies of ``byte`` (a kind of unit no executor knows)."""

    def __init__(self, name: str, byte: bytes, count: int) -> None:
        self.name, self.byte, self.count = name, byte, count

    @property
    def planned(self) -> tuple[str, int, tuple[str, ...]]:
        return self.name, self.count, ()

    def run(self, folder_url, cancel=None, *, chunk_bytes, threads=1, on_bytes=None) -> FileRecord:
        with HashingWriter(storage.join(folder_url, self.name)) as out:
            for start in range(0, self.count, chunk_bytes):
                if cancel is not None and cancel.is_set():
                    raise WriteCancelled(self.name)
                out.write(self.byte * min(chunk_bytes, self.count - start))
                if on_bytes is not None:
                    on_bytes(min(chunk_bytes, self.count - start))
        return FileRecord(self.name, out.size, out.sha256())


def _output(seen: list[list[str]]) -> PlannedOutput:
    units = [_Repeated(f"part-{i}.bin", bytes([65 + i]), 1000 + 37 * i) for i in range(5)]

    def finish(records: list[FileRecord], folder_url: str) -> list[FileRecord]:
        seen.append([r.file for r in records])
        data = "".join(r.sha256 for r in records).encode()
        storage.write_bytes(storage.join(folder_url, "sums.txt"), data)
        return [FileRecord("sums.txt", len(data), hashlib.sha256(data).hexdigest())]

    def then(folder_url: str) -> list[tuple[str, int]]:
        storage.write_bytes(storage.join(folder_url, "note.txt"), b"done")
        return [("note.txt", 4)]

    return PlannedOutput(units, "sub", finish, then)


@pytest.mark.parametrize("workers", [1, 3])
def test_an_executor_runs_any_work_unit(workers, tmp_path):
    seen: list[list[str]] = []
    progress: list[int] = []
    url = str(tmp_path / "out")
    written = LocalExecutor(workers).write(None, [_output(seen)], url, chunk_bytes=256, on_bytes=progress.append)
    names = [f"part-{i}.bin" for i in range(5)]
    assert seen == [names]
    assert [name for name, _ in written.files] == [f"sub/{n}" for n in [*names, "sums.txt", "note.txt"]]
    for name, size in written.files:
        data = (tmp_path / "out" / name).read_bytes()
        assert len(data) == size
        if name != "sub/note.txt":
            assert written.checksums[name] == hashlib.sha256(data).hexdigest()
    assert "sub/note.txt" not in written.checksums  # not a unit's or finish's file: hashed by the job, once
    assert sum(progress) == sum(1000 + 37 * i for i in range(5))


def test_the_same_units_give_the_same_bytes_on_any_number_of_threads(tmp_path):
    one = LocalExecutor(1).write(None, [_output([])], str(tmp_path / "one"), chunk_bytes=100, on_bytes=None)
    four = LocalExecutor(4).write(None, [_output([])], str(tmp_path / "four"), chunk_bytes=333, on_bytes=None)
    assert one.files == four.files and one.checksums == four.checksums


class _Failing:
    planned = ("bad.bin", 1, ())

    def __init__(self, started: threading.Event) -> None:
        self.started = started

    def run(self, folder_url, cancel=None, *, chunk_bytes, threads=1, on_bytes=None) -> FileRecord:
        assert self.started.wait(10)  # the other unit is running: it must be stopped, not dropped
        raise CorruptShard("the source ended early", "s3://bucket/rank_0.pt")


class _Waiting:
    """Runs until cancelled; records that it stopped."""

    planned = ("slow.bin", 1, ())

    def __init__(self) -> None:
        self.started, self.stopped = threading.Event(), threading.Event()

    def run(self, folder_url, cancel=None, *, chunk_bytes, threads=1, on_bytes=None) -> FileRecord:
        self.started.set()
        try:
            while not cancel.wait(0.01):
                pass
            raise WriteCancelled("slow.bin")
        finally:
            self.stopped.set()


class _NeverRun:
    planned = ("never.bin", 1, ())
    ran = False

    def run(self, *args, **kwargs) -> FileRecord:
        _NeverRun.ran = True
        raise AssertionError("a unit not started ran after the failure")


def test_the_first_failure_cancels_the_other_units(tmp_path):
    waiting = _Waiting()
    units = [waiting, _Failing(waiting.started), _NeverRun(), _NeverRun()]
    with pytest.raises(CorruptShard, match="the source ended early") as info:
        run_units(units, str(tmp_path), workers=2, chunk_bytes=1)
    assert info.value.path == "s3://bucket/rank_0.pt"
    assert waiting.stopped.is_set()  # stopped before the error was raised
    assert not _NeverRun.ran


def test_a_shard_and_a_rank_file_are_the_same_kind_of_unit(megatron_runs, tmp_path):
    """The units of a merge and of a split: each `run` gives a `FileRecord` naming its planned file."""
    from merge_engine.commands.merge import MergeJob
    from merge_engine.commands.split import SplitJob
    from merge_engine.output.jobs import OutputOptions
    from synthetic_runs.megatron import REFERENCE_HF_DIR

    hf = str(megatron_runs["llama_tp1_pp1_legacy"].reference_dir / REFERENCE_HF_DIR)
    for job in (MergeJob(hf, str(tmp_path / "merged"), OutputOptions(max_shard_size=200_000)),
                SplitJob(hf, str(tmp_path / "split"), OutputOptions(tp=2))):
        job.fingerprint()
        prepared = job.prepare()
        try:
            [output] = prepared.outputs
            unit = output.units[0]
            record = unit.run(str(tmp_path / job.command), None, chunk_bytes=1 << 20)
        finally:
            prepared.close()
        assert isinstance(record, FileRecord) and record.file == unit.planned[0], job.command
        data = (tmp_path / job.command / record.file).read_bytes()
        assert (record.size, record.sha256) == (len(data), hashlib.sha256(data).hexdigest())
