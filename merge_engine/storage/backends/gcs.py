"""Google Cloud Storage (``gs://``, ``gcs://``) through gcsfs.

An emulator from ``STORAGE_EMULATOR_HOST`` (then anonymous, and gcsfs's plain client class);
``STEPMERGE_STORAGE_TIMEOUT`` bounds connecting and each socket read (gcsfs's own ``timeout=``
does not bound a stalled response). A file's version is its generation, which changes exactly
when the content is rewritten. A read pinned to it asks for that generation (``?generation=``: the
bytes of that version or 404 once it is gone) and checks the ``x-goog-generation`` served. Why not
``ifGenerationMatch``: fake-gcs-server ignores it on media downloads (it served the new object's
bytes, seen here); the generation in the URL it honours, as GCS does. Transient: 408/429/5xx, transport errors.
"""

from __future__ import annotations

import os
from typing import Any

from merge_engine.errors import CredentialsMissing, SourceChanged
from merge_engine.storage.backend import FsspecBackend, storage_timeout
from merge_engine.storage.faults import RETRY_STATUSES, instance_of


class GcsBackend(FsspecBackend):
    schemes = ("gs", "gcs")
    env_keys = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")
    # the generation changes exactly when the content is rewritten (the etag also on metadata edits)
    version_keys = ("generation", "md5Hash", "crc32c", "etag", "updated")

    def portable_options(self) -> dict[str, Any]:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if not emulator or emulator == "default":
            return {}
        if not emulator.startswith(("http://", "https://")):
            emulator = "http://" + emulator
        return {"token": "anon", "endpoint_url": emulator}

    def check_credentials(self, url: str) -> None:
        """Google's own lookup (GOOGLE_APPLICATION_CREDENTIALS, gcloud's default credentials, the
        metadata server): when it finds nothing, gcsfs falls back to anonymous access and retries every
        refused request for minutes. An emulator (STORAGE_EMULATOR_HOST) needs none."""
        if "endpoint_url" in self.portable_options():
            return
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            google.auth.default()
        except DefaultCredentialsError:
            raise CredentialsMissing("no Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS to a "
                                     "service account key file (or run `gcloud auth application-default login`)",
                                     url, store="gs") from None

    def make_client(self, **common: Any) -> Any:
        options = self.portable_options()
        timeout = storage_timeout()
        if timeout:
            import aiohttp

            options["requests_timeout"] = aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
        return _client_class(emulated="endpoint_url" in options)(**options, **common)

    def path_in(self, fs: Any, url: str, rest: str) -> str:
        return rest

    async def read_range(self, fs: Any, path: str, start: int, end: int, version: str | None, url: str) -> bytes:
        if end <= start:
            return b""
        pinned = version if version and version.isdigit() else None  # a generation (not an md5 fallback)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        try:
            served_headers, data = await fs._call("GET", fs.url(path, generation=pinned), headers=headers)
        except FileNotFoundError:
            if pinned:
                raise SourceChanged(f"generation {pinned}, the one listed, is gone: the object was replaced or "
                                    "deleted since it was listed", url) from None
            raise
        served = served_headers.get("x-goog-generation")
        if pinned and served and served != pinned:
            raise SourceChanged(f"changed since it was listed: generation {served} served where {pinned} was "
                                "listed", url)
        return data

    def classify_fault(self, exc: BaseException) -> bool | None:
        if instance_of(exc, "gcsfs.retry", "HttpError"):
            return getattr(exc, "code", None) in RETRY_STATUSES or str(getattr(exc, "code", "")) in {
                str(s) for s in RETRY_STATUSES
            }
        if instance_of(exc, "google.auth.exceptions", "TransportError"):
            return True
        if instance_of(
            exc, "google.api_core.exceptions",
            "TooManyRequests", "ServiceUnavailable", "InternalServerError", "GatewayTimeout", "DeadlineExceeded",
        ):
            return True
        return None


def _client_class(emulated: bool) -> type:
    if emulated:
        # gcsfs picks its experimental subclass at import time unless this is "false"; against an
        # emulator that subclass waits ~60 s per call. Use the plain class whatever was imported.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem
    import fsspec

    return fsspec.get_filesystem_class("gcs")


BACKEND = GcsBackend()
