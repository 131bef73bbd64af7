"""`S3PartsUpload`: a streamed S3 multipart upload whose parts travel in the background, several at once.

s3fs's own file object sends each part when its buffer fills, and waits for it: the writer (a
shard job: read, cast, hash, write) stands still for every part's round trip and transfer, so a
merge to ``s3://`` runs at one connection's speed (docs/scaling.md, "Figures behind the engine's choices").
Here a full part is handed to a small thread pool and the writer
goes on; at most `tuning.UPLOAD_PARTS_IN_FLIGHT` parts are held (sent or waiting), so memory is
(that + 1) x the part size per upload.

Contract (the storage layer's `Upload`):
- ``write`` streams bytes; the object appears only on `commit`, whole (CompleteMultipartUpload),
  or as one PUT when it is smaller than a part. `discard` aborts the multipart upload: nothing
  appears, and no part is left stored.
- parts are ``block_size`` bytes (default `tuning.UPLOAD_PART`; larger when S3's 10,000-part limit
  needs it for ``size_hint``); every part but the last is full, as S3 requires.
- each request is retried on transient faults (`faults.retrying` with the backend's rule); a part
  that fails for good fails the next ``write`` or the `commit`, with that error.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from merge_engine.storage import tuning
from merge_engine.storage.faults import logger, retrying

__all__ = ["MAX_PARTS", "MIN_PART", "S3NumberedParts", "S3PartsUpload"]

MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload


class S3PartsUpload:
    """One object written through an s3fs filesystem ``fs`` at ``path`` (see the module docstring)."""

    def __init__(self, fs: Any, path: str, url: str, classify: Any, block_size: int | None,
                 size_hint: int | None) -> None:
        self.url = url
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._classify = classify
        part = block_size or tuning.UPLOAD_PART
        if size_hint:
            part = max(part, -(-size_hint // MAX_PARTS))
        self._part = part
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._sent: list[Future] = []
        in_flight = max(1, tuning.UPLOAD_PARTS_IN_FLIGHT)
        self._slots = threading.BoundedSemaphore(in_flight)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = in_flight

    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        return retrying(lambda: self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs),
                        f"{what} of {self.url}", self._classify)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self._part - len(self._buffer))
            self._buffer += view[:take]  # the one copy of the caller's bytes (it reuses its buffers)
            view = view[take:]
            if len(self._buffer) == self._part:
                # the part's own buffer is the request body: botocore checksums and sends a bytearray as
                # it is (a `bytes` body costs another copy, and a BytesIO read back in pieces for each checksum)
                self._send(self._buffer)
                self._buffer = bytearray()

    def flush(self) -> None:
        pass  # a part is sent when it is full, never early

    def _send(self, body: bytearray) -> None:
        self._raise_failed()
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", "starting the upload")["UploadId"]
            self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="stepmerge-upload")
        self._slots.acquire()  # at most UPLOAD_PARTS_IN_FLIGHT parts held
        number = len(self._sent) + 1
        assert self._pool is not None  # started with the upload
        try:
            future = self._pool.submit(self._put_part, number, body)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._sent.append(future)

    def _put_part(self, number: int, body: bytearray) -> dict[str, Any]:
        answer = self._call("upload_part", f"part {number}", PartNumber=number, UploadId=self._upload_id, Body=body)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _raise_failed(self) -> None:
        for future in self._sent:
            if future.done() and (failure := future.exception()) is not None:
                raise failure

    def commit(self) -> None:
        if self._upload_id is None:  # smaller than a part: one PUT
            body = bytes(self._buffer)
            retrying(lambda: self._fs.pipe_file(self._path, body), f"writing {self.url}", self._classify)
            return
        if self._buffer:
            self._send(self._buffer)
            self._buffer = bytearray()
        parts = [future.result() for future in self._sent]
        self._call("complete_multipart_upload", "completing the upload", UploadId=self._upload_id,
                   MultipartUpload={"Parts": parts})
        self._close_pool()

    def discard(self) -> None:
        for future in self._sent:
            future.cancel()
        self._close_pool()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", "aborting the upload", UploadId=self._upload_id)
            except Exception as exc:  # the upload is abandoned either way: its parts expire
                logger.warning("could not abort the upload to %s: %s", self.url, exc)
            self._upload_id = None

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


MIN_PART = 5 * 1024 * 1024  # S3's smallest part but the last


class S3NumberedParts:
    """One object of a known ``size`` written as numbered parts, from several threads, in any order (the
    storage layer's `PartsUpload`): part ``index`` is S3 part number ``index + 1``.

    ``part_bytes`` is at least `MIN_PART` (S3 refuses a smaller part but the last) and large enough
    for S3's 10,000-part limit. The multipart upload is started by the first part; each part is one
    UploadPart, retried on transient faults. `commit` completes the upload with the parts in number
    order; `discard` aborts it (no part stays stored)."""

    def __init__(self, fs: Any, path: str, url: str, classify: Any, size: int, part_bytes: int) -> None:
        self.url = url
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._classify = classify
        part = max(part_bytes, MIN_PART, -(-size // MAX_PARTS))
        self.part_bytes = -(-part // 4096) * 4096  # whole pages: every element of a tensor lies in one part
        self._count = max(1, -(-size // self.part_bytes))
        self._lock = threading.Lock()
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}

    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        return retrying(lambda: self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs),
                        f"{what} of {self.url}", self._classify)

    def _started(self) -> str:
        with self._lock:
            if self._upload_id is None:
                self._upload_id = self._call("create_multipart_upload", "starting the upload")["UploadId"]
            return self._upload_id

    def buffer(self, size: int) -> Any:
        return bytearray(size)

    def write_part(self, index: int, data: memoryview) -> None:
        upload_id = self._started()
        body = _whole_bytearray(data) or bytes(data)  # the part's own buffer as it is: no copy of every byte
        answer = self._call("upload_part", f"part {index + 1}", PartNumber=index + 1, UploadId=upload_id, Body=body)
        with self._lock:
            self._parts[index + 1] = answer["ETag"]

    def commit(self) -> None:
        missing = [n for n in range(1, self._count + 1) if n not in self._parts]
        if missing:
            raise RuntimeError(f"{self.url}: parts {missing[:5]} were never written")
        self._call("complete_multipart_upload", "completing the upload", UploadId=self._started(),
                   MultipartUpload={"Parts": [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]})

    def discard(self) -> None:
        with self._lock:
            upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                self._call("abort_multipart_upload", "aborting the upload", UploadId=upload_id)
            except Exception as exc:  # the upload is abandoned either way: its parts expire
                logger.warning("could not abort the upload to %s: %s", self.url, exc)


def _whole_bytearray(data: memoryview) -> bytearray | None:
    """The `bytearray` ``data`` views whole (botocore sends and checksums one as it is; a memoryview it
    refuses), else None. Safe for a synchronous request: the caller keeps its buffer unchanged until
    `write_part` returns (a retry resends the same bytes)."""
    owner = getattr(data, "obj", None)
    if isinstance(owner, bytearray) and data.contiguous and data.nbytes == len(owner) and data.format == "B":
        return owner
    return None
