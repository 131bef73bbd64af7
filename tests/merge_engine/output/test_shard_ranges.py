"""One output shard written by several workers on its byte ranges (issue 19, point 2).

Specification:
- a one-shard output written with 2 or 3 workers is byte-identical to one worker's, locally (plain
  path and ``file://``), on ``s3://`` (SeaweedFS), and in order on ``gs://`` (fake GCS) and ``memory://``, with and without a cast, tensors misaligned by
  an odd-sized one included; the sha256 recorded (the shard job's record, ``stepmerge.json``'s
  ``sha256``) is that of the bytes stored; and the shard really was cut (ranges started > 1);
- on ``s3://`` each range part is a multipart part by number of at least 5 MiB (the object's ETag
  counts the parts);
- with two workers, two ranges of one shard are in flight at once (a source that lets no read through
  until two workers read at once: one worker would wait forever);
- a fault in one range (a storage fault while reading) stops the rest: no range starts after it,
  the error is raised, and no file (local: nor temp file; S3: nor multipart upload) is left;
- a tensor that cannot be produced from the middle (a builder without ``chunks_range``) is never cut.
"""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from merge_engine import storage

from merge_engine.output import shard_ranges
from merge_engine.errors import StorageUnavailable
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.output.jobs import OutputOptions, run_job
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.commands.merge import MergeJob
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor, assign_shards
from merge_engine.output.shard_ranges import GAUGE
from merge_engine.storage import s3_upload
from merge_engine.storage.schemes import backend_for
from tests.merge_engine.output.plan_writer import write_plan

MiB = 1024 * 1024
SMALL = {  # an odd-sized bool tensor puts every tensor after it off its element alignment
    "a.weight": torch.randn(300, 170, generator=torch.Generator().manual_seed(1)),
    "b.weight": torch.randn(10003, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
    "c.mask": torch.ones(7, dtype=torch.bool),
    "d.weight": torch.randn(40001, generator=torch.Generator().manual_seed(3)),
    "e.bias": torch.arange(5, dtype=torch.int64),
    "f.scalar": torch.tensor(2.5, dtype=torch.float16),
}
LARGE = {f"layer{i}.weight": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)}


def _reset_gauge() -> None:
    """`GAUGE` counts from now on (no range in flight between tests): peak and started back to zero."""
    GAUGE.peak, GAUGE.started = GAUGE.in_flight, 0


def _open(folder, tensors):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return open_checkpoint(check_checkpoint(str(folder)))


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    source = _open(tmp_path_factory.mktemp("ranges") / "small", SMALL)
    yield source
    source.close()


@pytest.fixture(scope="module")
def large_source(tmp_path_factory):
    """24 MB of fp32: 12 MB in bf16, three S3 parts of 5 MiB."""
    source = _open(tmp_path_factory.mktemp("ranges") / "large", LARGE)
    yield source
    source.close()


def _plan(tensors, dtype=None, builders=None) -> MergePlan:
    planned = [PlannedTensor(n, tuple(t.shape), dtype if dtype is not None and t.dtype.is_floating_point else t.dtype,
                             n, build=(builders or {}).get(n)) for n, t in tensors.items()]
    return MergePlan(tuple(planned), assign_shards(planned, 10**12))


def _written(plan, source, url, workers) -> tuple[bytes, str, int]:
    _reset_gauge()
    written = write_plan(plan, source, url, chunk_bytes=10_000, workers=workers)
    (record,) = written.records
    return storage.read_bytes(storage.join(url, "model.safetensors")), record.sha256, GAUGE.started


@pytest.fixture()
def small_parts(monkeypatch):
    monkeypatch.setattr(shard_ranges, "PART_BYTES", 8192)


@pytest.mark.parametrize("scheme, dtype", [("path", None), ("path", torch.bfloat16), ("file", torch.bfloat16),
                                           ("gs", torch.bfloat16), ("memory", None)])
def test_ranges_give_the_bytes_of_one_worker(scheme, dtype, small_source, small_parts, tmp_path, request):
    """Local targets take the parts at their places; ``gs://`` and ``memory://`` take a file's bytes only in
    order (GCS compose is not used: see `merge_engine.output.shard_ranges`): the parts are still produced by
    every worker, and written in order by the hashing thread."""
    root = {"path": str(tmp_path), "file": f"file://{tmp_path}", "memory": f"memory://ranges-{tmp_path.name}"}.get(
        scheme) or request.getfixturevalue("gcs_bucket_url") + "/ranges"
    plan = _plan(SMALL, dtype)
    expected, digest, started = _written(plan, small_source, f"{root}/one", 1)
    assert started == 0  # one worker: the shard job of old, no ranges
    assert hashlib.sha256(expected).hexdigest() == digest
    for workers in (2, 3):
        got, got_digest, started = _written(plan, small_source, f"{root}/w{workers}", workers)
        assert got == expected, workers
        assert got_digest == digest
        assert started == -(-len(expected) // 8192) > 1  # one range per part: the shard was cut
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_s3_parts_are_numbered_and_at_least_5_mib(large_source, s3_bucket_url, tmp_path):
    """S3 refuses a part under 5 MiB but the last (SeaweedFS too): asked for 1 MiB parts, the store
    raises them to its 5 MiB floor: 3 parts for 12 MB."""
    plan = _plan(LARGE, torch.bfloat16)
    expected, digest, _ = _written(plan, large_source, str(tmp_path / "one"), 1)
    url = f"{s3_bucket_url}/ranges"
    shard_ranges.PART_BYTES, before = MiB, shard_ranges.PART_BYTES
    try:
        for workers in (2, 3):
            got, got_digest, started = _written(plan, large_source, f"{url}/w{workers}", workers)
            assert got == expected and got_digest == digest, workers
            assert started == 3
            etag = backend_for(url).info(f"{url}/w{workers}/model.safetensors")["ETag"].strip('"')
            assert etag.endswith("-3"), etag  # a multipart object of 3 parts
    finally:
        shard_ranges.PART_BYTES = before


def _merged_files(source: str, target: str, workers: int) -> dict[str, bytes]:
    """``stepmerge merge --dtype bfloat16 --workers N``: the files written, ``stepmerge.json``'s ``sha256``
    checked against the bytes stored (and left out: it records the target)."""
    result = run_job(MergeJob(source, target, OutputOptions(dtype="bfloat16")), executor=LocalExecutor(workers))
    files = {e.path: storage.read_bytes(storage.join(result.target_url, e.path))
             for e in storage.list_files(result.target_url)}
    assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"]
    recorded = json.loads(files.pop("stepmerge.json"))["sha256"]
    assert recorded["model.safetensors"] == hashlib.sha256(files["model.safetensors"]).hexdigest()
    return files


@pytest.fixture(scope="module")
def one_worker_merge(fsdp_runs, tmp_path_factory):
    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    return source, _merged_files(source, str(tmp_path_factory.mktemp("ranges") / "one"), 1)


@pytest.mark.parametrize("scheme, workers", [("path", 2), ("file", 3)])
def test_a_one_shard_merge_uses_every_worker(scheme, workers, one_worker_merge, tmp_path, small_parts):
    """`stepmerge merge --workers 2 / 3` of a one-shard model: the same files as one worker, the sha256 in
    ``stepmerge.json`` is that of the bytes stored, and the shard was cut into ranges. (``s3://``: the
    tiny model is below S3's 5 MiB part floor, which SeaweedFS enforces; `test_s3_parts_...` covers it.)"""
    source, expected = one_worker_merge
    root = str(tmp_path) if scheme == "path" else f"file://{tmp_path}"
    _reset_gauge()
    assert _merged_files(source, f"{root}/out", workers) == expected
    assert GAUGE.started > 1


class _GatedSource:
    """A real source whose reads wait, at each worker thread's first read, until ``parties`` threads read
    at once (one worker alone waits until ``timeout`` and fails). ``fail_at`` (name, first element):
    that ranged read raises a storage fault once through the gate; every other read then waits until
    the failing range has left `GAUGE` (the failure recorded) before it yields, and is counted."""

    def __init__(self, inner, parties: int = 2, fail_at: tuple[str, int] | None = None,
                 timeout: float = 20.0) -> None:
        self.url = inner.url
        self._inner = inner
        self._gate = threading.Barrier(parties, timeout=timeout)
        self._passed: set[int] = set()
        self._fail_at = fail_at
        self.failed = threading.Event()
        self.reads_after_failure = 0

    def metas(self):
        return self._inner.metas()

    def read(self, name):
        return self._inner.read(name)

    def close(self) -> None:
        pass

    def _enter(self) -> None:
        me = threading.get_ident()
        if me not in self._passed:
            self._gate.wait()
            self._passed.add(me)

    def _held(self, chunks):
        for chunk in chunks:
            if self._fail_at is not None:
                _wait_for(lambda: self.failed.is_set() and GAUGE.in_flight <= 1)
                self.reads_after_failure += 1
            yield chunk

    def iter_chunks(self, name, max_bytes):
        self._enter()
        yield from self._held(self._inner.iter_chunks(name, max_bytes))

    def iter_range(self, name, start, count, max_bytes):
        self._enter()
        if (name, start) == self._fail_at:
            self.failed.set()
            raise StorageUnavailable("the store stayed unreachable", f"{self.url}/model.safetensors")
        yield from self._held(self._inner.iter_range(name, start, count, max_bytes))


def _wait_for(condition, timeout: float = 20.0) -> None:
    done = threading.Event()
    while not condition():
        if done.wait(0.01) or timeout <= 0:
            raise AssertionError("state never reached")
        timeout -= 0.01


def test_two_ranges_of_one_shard_are_in_flight_at_once(small_source, small_parts, tmp_path):
    plan = _plan(SMALL)
    expected, _, _ = _written(plan, small_source, str(tmp_path / "one"), 1)
    _reset_gauge()
    write_plan(plan, _GatedSource(small_source), str(tmp_path / "two"), chunk_bytes=10_000, workers=2)
    assert GAUGE.peak >= 2
    assert (tmp_path / "two" / "model.safetensors").read_bytes() == expected


@pytest.mark.parametrize("scheme", ["path", "s3"])
def test_a_fault_in_one_range_stops_the_rest_and_leaves_nothing(scheme, small_source, large_source, tmp_path,
                                                                request, monkeypatch):
    """Range 1 meets a storage fault while range 0 is in flight: range 0 stops at its next chunk, no
    range starts after the fault, the fault is raised, and the target holds nothing (nor a temp file,
    nor an unfinished multipart upload)."""
    if scheme == "s3":
        tensors, source, part = LARGE, large_source, s3_upload.MIN_PART
        root = request.getfixturevalue("s3_bucket_url") + "/fault"
    else:
        tensors, source, part = SMALL, small_source, 8192
        root = str(tmp_path / "fault")
    monkeypatch.setattr(shard_ranges, "PART_BYTES", part)
    plan = _plan(tensors)
    at = len(shard_ranges.shard_header(plan, plan.shards[0]))
    for tensor in plan.tensors:  # the tensor holding the first byte of range 1, and its element there
        if at + tensor.nbytes > part:
            fail_at = (tensor.name, (part - at) // tensor.dtype.itemsize)
            break
        at += tensor.nbytes
    gated = _GatedSource(source, fail_at=fail_at)
    _reset_gauge()
    with pytest.raises(StorageUnavailable, match="unreachable"):
        write_plan(plan, gated, root, chunk_bytes=4096, workers=2)
    assert GAUGE.started == 2 and GAUGE.in_flight == 0
    assert gated.reads_after_failure <= 1
    assert storage.list_files(root) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("stepmerge-range")]
    if scheme == "s3":
        fs, path = backend_for(root).filesystem(root)
        bucket, prefix = path.split("/", 1)
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        assert not [u for u in uploads if u["Key"].startswith(prefix)]


class _WholeOnly:
    """A builder that can only produce its tensor from the start (no ``chunks_range``)."""

    inputs = ("d.weight",)

    def chunks(self, source, max_bytes):
        return source.iter_chunks("d.weight", max_bytes)


def test_a_tensor_without_a_ranged_read_is_never_cut(small_source, small_parts, tmp_path):
    plan = _plan(SMALL, builders={"d.weight": _WholeOnly()})
    shard = plan.shards[0]
    header = len(shard_ranges.shard_header(plan, shard))
    spans = shard_ranges._spans(plan, shard, small_source, header)
    ranges = shard_ranges.cut_ranges(spans, header + shard.size, 8192)
    (whole,) = [s for s in spans if s.whole_only]
    holding = [(a, b) for a, b in ranges if a * 8192 < whole.end and b * 8192 > whole.start]
    assert len(holding) == 1 and len(ranges) > 2
    expected, _, _ = _written(_plan(SMALL), small_source, str(tmp_path / "one"), 1)
    got, _, _ = _written(plan, small_source, str(tmp_path / "two"), 2)
    assert got == expected
