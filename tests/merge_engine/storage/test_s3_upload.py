"""`S3PartsUpload` (``s3://`` streamed writes): parts sent in the background, a bounded number at once.

Specification (on top of `test_atomic_writer`'s, which every backend meets):
- while the writer goes on, at most `tuning.UPLOAD_PARTS_IN_FLIGHT` parts are held; the object is
  byte-exact, one S3 part per ``block_size``;
- a discarded upload leaves no multipart upload open on the server (no stored parts).
"""

from __future__ import annotations

import threading

import pytest

from merge_engine import storage
from merge_engine.storage.s3_upload import S3NumberedParts, S3PartsUpload
from merge_engine.storage.schemes import backend_for
from tests.clock import HANG_S, until
from tests.merge_engine.storage.patterned import MiB, patterned_bytes


class _WatchedSlots:
    """The upload's slot semaphore, watched: ``blocked`` is set when the writer asks for a slot and none is
    free; ``taken_when_blocked`` lists the slots held at each such moment."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self._slots, self.blocked, self.taken_when_blocked = slots, threading.Event(), []
        self._taken, self._lock = 0, threading.Lock()

    def acquire(self) -> bool:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.taken_when_blocked.append(self._taken)
            self.blocked.set()  # the writer waits for a part to finish: the bound holds it back
            self._slots.acquire()
        with self._lock:
            self._taken += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._taken -= 1
        self._slots.release()


def test_parts_in_flight_are_bounded_and_the_object_is_exact(s3_bucket_url, monkeypatch):
    """No part can finish until the writer is seen waiting for a slot: it waits with exactly the bound's
    parts held, then the parts go and the object is byte-exact."""
    monkeypatch.setattr(storage.tuning, "UPLOAD_PARTS_IN_FLIGHT", 2)
    network = threading.Event()  # closed: a part being sent waits for it
    put_part, init = S3PartsUpload._put_part, S3PartsUpload.__init__
    uploads: list[S3PartsUpload] = []

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._slots = _WatchedSlots(self._slots)
        uploads.append(self)

    def held_put_part(self, number, body):
        assert network.wait(HANG_S), "the network never opened"
        return put_part(self, number, body)

    monkeypatch.setattr(S3PartsUpload, "__init__", watched_init)
    monkeypatch.setattr(S3PartsUpload, "_put_part", held_put_part)
    url = storage.join(s3_bucket_url, "parts.bin")
    data = patterned_bytes(MiB, seed=3) * 26  # 5 full parts of 5 MiB and a 1 MiB tail
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with storage.open_write(url, block_size=5 * MiB) as out:
                for at in range(0, len(data), 3 * MiB):
                    out.write(data[at:at + 3 * MiB])
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        until(lambda: uploads and uploads[0]._slots.blocked.is_set(), "the writer waits for a slot")
        assert uploads[0]._slots.taken_when_blocked == [2]  # the bound, not fewer, not more
    finally:
        network.set()
        writer.join(HANG_S)
    assert not errors and not writer.is_alive()
    assert storage.read_bytes(url) == data
    (entry,) = storage.list_files(url.rsplit("/", 1)[0])
    assert entry.version.endswith("-6")


def test_a_discarded_upload_leaves_no_parts(s3_bucket_url):
    url = storage.join(s3_bucket_url, "discarded.bin")
    fs, path = backend_for(url).filesystem(url)
    bucket = path.split("/", 1)[0]

    def open_uploads() -> list:
        return fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])

    with pytest.raises(RuntimeError):
        with storage.open_write(url, block_size=5 * MiB) as out:
            out.write(b"x" * (11 * MiB))  # two parts sent
            assert len(open_uploads()) == 1
            raise RuntimeError("writer crashed")
    assert open_uploads() == []
    assert not storage.exists(url)


def test_numbered_parts_in_any_order_give_the_object_and_a_discard_leaves_none(s3_bucket_url):
    """`S3NumberedParts` (`storage.open_parts`): parts of at least 5 MiB whatever is asked, written from
    threads in reverse order, give the exact object of that many parts; a discarded one leaves no upload."""
    url = storage.join(s3_bucket_url, "numbered.bin")
    fs, path = backend_for(url).filesystem(url)
    bucket = path.split("/", 1)[0]
    data = patterned_bytes(MiB, seed=5) * 11  # parts of 5, 5 and 1 MiB
    upload = storage.open_parts(url, len(data), 1024)
    assert isinstance(upload, S3NumberedParts) and upload.part_bytes == 5 * MiB
    step = upload.part_bytes
    threads = [threading.Thread(target=upload.write_part, args=(i, memoryview(data)[i * step:(i + 1) * step]))
               for i in reversed(range(3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not storage.exists(url)
    upload.commit()
    assert storage.read_bytes(url) == data
    assert backend_for(url).info(url)["ETag"].strip('"').endswith("-3")

    discarded = storage.open_parts(storage.join(s3_bucket_url, "numbered-discarded.bin"), len(data), 0)
    discarded.write_part(1, memoryview(data)[step:2 * step])
    assert len(fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])) == 1
    discarded.discard()
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert not storage.exists(storage.join(s3_bucket_url, "numbered-discarded.bin"))


def test_a_part_is_sent_from_its_own_buffer_copied_once_from_the_callers(s3_bucket_url, monkeypatch):
    """The part's buffer is the request body (no second copy into `bytes`); the caller may reuse its
    buffer as soon as ``write`` returns."""
    bodies = []
    put_part = S3PartsUpload._put_part

    def recording_put_part(self, number, body):
        bodies.append(type(body))
        return put_part(self, number, body)

    monkeypatch.setattr(S3PartsUpload, "_put_part", recording_put_part)
    url = storage.join(s3_bucket_url, "reused.bin")
    data = patterned_bytes(MiB, seed=5) * 12
    buffer = bytearray(4 * MiB)
    with storage.open_write(url, block_size=5 * MiB) as out:
        for at in range(0, len(data), 4 * MiB):
            buffer[:] = data[at:at + 4 * MiB]
            out.write(buffer)
            buffer[:] = b"\0" * len(buffer)  # the caller reuses its buffer at once
    assert bodies == [bytearray, bytearray, bytearray]  # 12 MiB in parts of 5: two full parts and the tail
    assert storage.read_bytes(url) == data


def test_a_numbered_part_is_sent_from_the_callers_whole_buffer_without_a_copy(s3_bucket_url, monkeypatch):
    """`S3NumberedParts.write_part` of a view of a whole bytearray sends that bytearray (a part's bytes are
    not copied once more); a view of part of a buffer is copied, and both give the exact object."""
    bodies = []
    call = S3NumberedParts._call

    def recording_call(self, method, what, **kwargs):
        if method == "upload_part":
            bodies.append(kwargs["Body"])
        return call(self, method, what, **kwargs)

    monkeypatch.setattr(S3NumberedParts, "_call", recording_call)
    url = storage.join(s3_bucket_url, "whole.bin")
    data = patterned_bytes(MiB, seed=6) * 6
    upload = storage.open_parts(url, len(data), 5 * MiB)
    first = upload.buffer(upload.part_bytes)
    first[:] = data[:upload.part_bytes]
    tail = bytearray(data[upload.part_bytes:]) + bytearray(100)  # a larger buffer: only its start is the part
    upload.write_part(0, memoryview(first))
    upload.write_part(1, memoryview(tail)[:len(data) - upload.part_bytes])
    upload.commit()
    assert bodies[0] is first and type(bodies[1]) is bytes
    assert storage.read_bytes(url) == data


def test_uploads_are_listed_page_after_page_to_the_last(s3_bucket_url):
    """Every page of a truncated listing, each once (SeaweedFS pages by upload id: its truncated pages
    carry an upload-id marker and no key marker)."""
    backend = backend_for(s3_bucket_url)
    fs, path = backend.filesystem(s3_bucket_url)
    bucket = fs.split_path(path)[0]
    keys = [f"out/part-{i}" for i in range(3)]
    for key in keys + ["elsewhere/x"]:
        fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    listed = backend._uploads(fs, bucket, "out/", s3_bucket_url, page_size=1)
    assert sorted(upload["Key"] for upload in listed) == keys
