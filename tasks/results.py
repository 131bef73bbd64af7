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
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Union

from prefect.filesystems import RemoteFileSystem

from merge_engine.storage.schemes import backend_for_scheme, remote_schemes
from merge_engine.storage.urls import scheme_of

_SAVED: dict[tuple[str, str], RemoteFileSystem] = {}


def remote_result_storage(url: str) -> RemoteFileSystem:
    """An (unsaved) `RemoteFileSystem` block at an object-store URL (``s3://``, ``gs://``: any of the
    storage registry's `remote_schemes`), with the engine's client options for that store."""
    scheme = (scheme_of(url) or "") if "://" in url else ""  # case-insensitive: S3:// is s3://
    if scheme not in remote_schemes():
        raise ValueError(f"result storage must be a URL of an object store ({', '.join(remote_schemes())}), "
                         f"got {url!r}")
    settings: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False,
                                **backend_for_scheme(scheme).portable_options()}
    return RemoteFileSystem(basepath=url.rstrip("/") + "/", settings=settings)


def saved_result_storage(url: str) -> RemoteFileSystem:
    """`remote_result_storage(url)` saved on the Prefect server (once per process, API and URL)."""
    from prefect.settings import PREFECT_API_URL

    key = (url, str(PREFECT_API_URL.value()))
    if key not in _SAVED:
        block = remote_result_storage(url)
        block.save(f"stepmerge-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}", overwrite=True)
        _SAVED[key] = block
    return _SAVED[key]


def configured_result_storage() -> Optional[Union[RemoteFileSystem, str]]:
    """The result storage ``STEPMERGE_RESULT_STORAGE`` names (saved), or None: Prefect's default.

    Call it inside a flow run (it may save a block on the server).
    """
    value = os.environ.get("STEPMERGE_RESULT_STORAGE", "").strip()
    if not value:
        return None
    if "://" in value:
        return saved_result_storage(value)
    return value  # a saved block's slug, e.g. "s3-bucket/results"
