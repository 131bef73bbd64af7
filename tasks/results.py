"""Where Prefect keeps the stage tasks' results (the cache): local by default, S3/GCS when configured.

- ``STEPMERGE_RESULT_STORAGE`` unset: Prefect's own default (the block named by
  ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` if set, else the local folder
  ``PREFECT_RESULTS_LOCAL_STORAGE_PATH``, by default ``~/.prefect/storage``).
- ``STEPMERGE_RESULT_STORAGE=s3://bucket/prefix`` or ``gs://bucket/prefix``: a Prefect
  `RemoteFileSystem` block at that URL, talking to the same endpoint as the engine
  (``STEPMERGE_S3_ENDPOINT`` / ``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``), so workers on
  several machines share one cache. Prefect only accepts result storage saved on the server, so
  `configured_result_storage` saves the block (``remote-file-system/stepmerge-results-<hash>``) the
  first time a flow run asks for it; the flows apply it to every stage task (`flows.stages`).
- ``STEPMERGE_RESULT_STORAGE=<block-type>/<block-name>``: that saved block, as it is.
Records are small (URLs, fingerprints, reports): a stage costs a few KB of result storage.

Every record is written by `tasks.result_records.RecordSerializer` (JSON, never a pickle), and the blocks
here read only such records (`GuardedLocalFileSystem`, `GuardedRemoteFileSystem`: `checked_record` on every
read): a record another party wrote naming Prefect's pickle serializer is `UnsafeRecord`, never loaded. The
local default is such a block too (``guarded-local-file-system/stepmerge-results-<hash>`` at
``PREFECT_RESULTS_LOCAL_STORAGE_PATH``); a saved block named by slug is used as it is (its reads are Prefect's).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Union

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem

from merge_engine.storage.schemes import backend_for_scheme, remote_schemes
from merge_engine.storage.urls import scheme_of
from tasks.result_records import checked_record

_SAVED: dict[tuple[str, str], WritableFileSystem] = {}


class GuardedLocalFileSystem(LocalFileSystem):
    """Prefect's local result storage that reads only stepmerge's JSON records (`checked_record`)."""

    _block_type_name = "Guarded Local File System"

    async def aread_path(self, path: str) -> bytes:
        return checked_record(await super().aread_path(path), path)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return checked_record(super().read_path(path, _sync=True), path)


class GuardedRemoteFileSystem(RemoteFileSystem):
    """Prefect's object-store result storage that reads only stepmerge's JSON records (`checked_record`)."""

    _block_type_name = "Guarded Remote File System"

    async def aread_path(self, path: str) -> bytes:
        return checked_record(await super().aread_path(path), path)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return checked_record(super().read_path(path, _sync=True), path)


def remote_result_storage(url: str) -> GuardedRemoteFileSystem:
    """An (unsaved) `GuardedRemoteFileSystem` block at an object-store URL (``s3://``, ``gs://``: any of the
    storage registry's `remote_schemes`), with the engine's client options for that store."""
    scheme = (scheme_of(url) or "") if "://" in url else ""  # case-insensitive: S3:// is s3://
    if scheme not in remote_schemes():
        raise ValueError(f"result storage must be a URL of an object store ({', '.join(remote_schemes())}), "
                         f"got {url!r}")
    settings: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False,
                                **backend_for_scheme(scheme).portable_options()}
    return GuardedRemoteFileSystem(basepath=url.rstrip("/") + "/", settings=settings)


def saved_result_storage(url: str) -> WritableFileSystem:
    """The guarded block for ``url`` (an object-store URL: `remote_result_storage`; a local folder:
    `GuardedLocalFileSystem`) saved on the Prefect server (once per process, API and URL)."""
    from prefect.settings import PREFECT_API_URL

    key = (url, str(PREFECT_API_URL.value()))
    if key not in _SAVED:
        block = remote_result_storage(url) if "://" in url else GuardedLocalFileSystem(basepath=url)
        block.save(f"stepmerge-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}", overwrite=True)
        _SAVED[key] = block
    return _SAVED[key]


def configured_result_storage() -> Optional[Union[WritableFileSystem, str]]:
    """The result storage ``STEPMERGE_RESULT_STORAGE`` names (saved), else the guarded local folder Prefect
    would use (``PREFECT_RESULTS_LOCAL_STORAGE_PATH``); None where Prefect is configured with a default
    storage block of its own (``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``: used as it is).

    Call it inside a flow run (it may save a block on the server).
    """
    value = os.environ.get("STEPMERGE_RESULT_STORAGE", "").strip()
    if not value:
        from prefect.settings import get_current_settings

        results = get_current_settings().results
        if results.default_storage_block is not None:
            return None
        return saved_result_storage(str(Path(results.local_storage_path).expanduser()))
    if "://" in value:
        return saved_result_storage(value)
    return value  # a saved block's slug, e.g. "s3-bucket/results"
