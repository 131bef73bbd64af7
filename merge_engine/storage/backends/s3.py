"""S3 and S3-compatible stores (``s3://``, ``s3a://``) through s3fs.

Endpoint from ``STEPMERGE_S3_ENDPOINT`` or ``AWS_ENDPOINT_URL``, credentials from the usual AWS
variables; ``STEPMERGE_STORAGE_TIMEOUT`` bounds connecting and each socket read. A file's version
is its ETag; a read pinned to it sends ``If-Match`` (the server answers 412 for any other version)
and checks the ETag served, so a store that ignored the header still cannot hand over other bytes. Transient: throttling codes (``SlowDown``, ...) and 408/429/5xx statuses, botocore's
connection and streaming errors.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from merge_engine.errors import CredentialsMissing, SourceChanged, StorageUnavailable
from merge_engine.storage import tuning
from merge_engine.storage.backend import FsspecBackend, storage_timeout
from merge_engine.storage.body import Body
from merge_engine.storage.s3_upload import MAX_PARTS, S3NumberedParts, S3PartsUpload
from merge_engine.storage.faults import RETRY_STATUSES, instance_of, retrying

_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "ProvisionedThroughputExceededException", "BandwidthLimitExceeded", "ServiceUnavailable",
    "InternalError", "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
    "EC2ThrottledException", "TransactionInProgressException", "OperationAborted",
    "408", "429", "500", "502", "503", "504",
})



class S3Backend(FsspecBackend):
    schemes = ("s3", "s3a")
    env_keys = (
        "STEPMERGE_S3_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    )

    def portable_options(self) -> dict[str, Any]:
        endpoint = os.environ.get("STEPMERGE_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
        return {"endpoint_url": endpoint} if endpoint else {}

    def check_credentials(self, url: str) -> None:
        """botocore's own lookup (environment, profile and config files, container and instance
        metadata): when it finds nothing, s3fs would fail every request with ``NoCredentialsError``."""
        import botocore.session

        if botocore.session.Session().get_credentials() is None:
            raise CredentialsMissing("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                     "(or AWS_PROFILE)", url, store="s3")

    def make_client(self, **common: Any) -> Any:
        import fsspec

        options = self.portable_options()
        # botocore keeps 10 connections by default: room for every ranged GET in flight, from several jobs
        config: dict[str, Any] = {"max_pool_connections": max(10, 4 * tuning.REQUESTS_IN_FLIGHT)}
        timeout = storage_timeout()
        if timeout:
            config.update(connect_timeout=timeout, read_timeout=timeout)
        options["config_kwargs"] = config
        return fsspec.get_filesystem_class("s3")(**options, **common)

    def upload_options(self, size: int) -> dict[str, Any]:
        # `tuning.UPLOAD_PARTS_IN_FLIGHT` parts held at once (s3fs reads a file under two parts whole);
        # parts grow only as S3's 10,000-part limit needs
        return {"chunksize": max(tuning.UPLOAD_PART, -(-size // MAX_PARTS)),
                "max_concurrency": max(1, tuning.UPLOAD_PARTS_IN_FLIGHT)}

    def open_upload(self, url: str, block_size: int | None, size_hint: int | None) -> S3PartsUpload:
        fs, path = self.filesystem(url)
        return S3PartsUpload(fs, path, url, self.classify_fault, block_size, size_hint)

    def open_parts(self, url: str, size: int, part_bytes: int) -> S3NumberedParts:
        fs, path = self.filesystem(url)
        return S3NumberedParts(fs, path, url, self.classify_fault, size, part_bytes)

    def abort_uploads(self, url: str, not_before: str) -> list[str]:
        """Multipart uploads under ``url``'s prefix (whole path components: ``out/`` never matches
        ``out2/``) initiated at or after ``not_before``'s LastModified (the server's clock, whole
        seconds); each aborted, retried on transient faults."""
        fs, path = self.filesystem(url)
        bucket, key, _ = fs.split_path(path)
        prefix = key.strip("/") + "/" if key.strip("/") else ""
        since = self.info(not_before).get("LastModified")
        if not isinstance(since, datetime.datetime):
            return []  # no date to tell this run's uploads from anyone else's: abort none
        since = since.replace(microsecond=0)
        aborted = []
        for upload in self._uploads(fs, bucket, prefix, url):
            initiated = upload.get("Initiated")
            if not upload.get("Key", "").startswith(prefix) or not isinstance(initiated, datetime.datetime) \
                    or initiated < since:
                continue
            try:
                retrying(lambda: fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                            UploadId=upload["UploadId"]),
                         f"aborting the upload of {upload['Key']}", self.classify_fault)
            except FileNotFoundError:  # NoSuchUpload: finished or aborted meanwhile
                continue
            aborted.append(upload["Key"][len(prefix):])
        return aborted

    def _uploads(self, fs: Any, bucket: str, prefix: str, url: str, page_size: int = 1000) -> list[dict[str, Any]]:
        """Every multipart upload in progress under ``prefix`` (all pages of ``page_size``)."""
        uploads: list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:
            page = retrying(lambda: fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix,
                                                MaxUploads=page_size, **markers),
                            f"listing the uploads under {url}", self.classify_fault)
            listed = page.get("Uploads", [])
            uploads += listed
            if not page.get("IsTruncated") or not listed:
                return uploads
            following = {"KeyMarker": page.get("NextKeyMarker") or "", "UploadIdMarker": page.get("NextUploadIdMarker") or ""}
            if following == markers or not any(following.values()):
                raise StorageUnavailable(f"the server's list of uploads under {url} does not move on to a next page", url)
            markers = following

    def path_in(self, fs: Any, url: str, rest: str) -> str:
        return rest

    async def read_range(self, fs: Any, path: str, start: int, end: int, version: str | None, url: str) -> bytes | Body:
        if end <= start:
            return b""
        bucket, key, version_id = fs.split_path(path)
        request: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if version_id:
            request["VersionId"] = version_id
        if version:
            request["IfMatch"] = f'"{version}"'
        try:
            response = await fs._call_s3("get_object", **request)
        except Exception as exc:
            if version and _precondition_failed(exc):
                raise SourceChanged(f"changed since it was listed: its ETag is no longer {version} (If-Match "
                                    "refused); nothing is read from another version", url) from None
            raise
        try:
            served = str(response.get("ETag") or "").strip('"')
            if version and served and served != version:
                raise SourceChanged(f"changed since it was listed: ETag {served} served where {version} was "
                                    "listed", url)
            return await _read_body(response["Body"])
        finally:
            response["Body"].close()

    def classify_fault(self, exc: BaseException) -> bool | None:
        if instance_of(exc, "botocore.exceptions", "ClientError"):
            response = getattr(exc, "response", None) or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in _THROTTLE_CODES or status in RETRY_STATUSES
        if instance_of(
            exc, "botocore.exceptions",
            "HTTPClientError", "ConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
            "ResponseStreamingError", "IncompleteReadError",
        ):
            return True
        return None


async def _read_body(body: Any) -> Body:
    """A GET's body in the pieces aiohttp received (`body.Body`: never joined, the reader copies it once),
    with aiobotocore's own translation of a stall or a dropped connection (botocore's `ReadTimeoutError`,
    `ResponseStreamingError`: transient). Another HTTP client's body is read whole."""
    content: Any = getattr(getattr(body, "raw_stream", None), "content", None)
    if not hasattr(content, "readchunk"):
        return Body([await body.read()])
    import asyncio

    import aiohttp
    from aiobotocore.response import AioReadTimeoutError
    from botocore.exceptions import ResponseStreamingError

    pieces: list[bytes] = []
    try:
        while True:
            piece, _ = await content.readchunk()  # one piece as received (readany/read join what is buffered)
            if not piece:
                if content.at_eof():
                    return Body(pieces)
                continue  # the end of an HTTP chunk, not of the body
            pieces.append(piece)
    except asyncio.TimeoutError as exc:
        raise AioReadTimeoutError(endpoint_url=body.raw_stream.url, error=exc) from exc
    except aiohttp.ClientConnectionError as exc:
        raise ResponseStreamingError(error=exc) from exc


def _precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (s3fs's OSError, or botocore's ClientError behind it) is a 412 Precondition Failed."""
    link: BaseException | None = exc
    for _ in range(8):
        if link is None:
            return False
        response = getattr(link, "response", None)
        if isinstance(response, dict) and (response.get("Error", {}).get("Code") == "PreconditionFailed" or
                                           response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412):
            return True
        link = link.__cause__ or link.__context__
    return False


BACKEND = S3Backend()
