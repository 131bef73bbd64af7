"""Where Prefect keeps the stage tasks' results (the cache), and the guard every such store reads through.

- ``STEPMERGE_RESULT_STORAGE`` unset: the block named by ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` if set,
  else the local folder ``PREFECT_RESULTS_LOCAL_STORAGE_PATH`` (by default ``~/.prefect/storage``).
- ``STEPMERGE_RESULT_STORAGE=s3://bucket/prefix`` or ``gs://bucket/prefix``: a Prefect
  `RemoteFileSystem` block at that URL, talking to the same endpoint as the engine
  (``STEPMERGE_S3_ENDPOINT`` / ``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``), so workers on
  several machines share one cache.
- ``STEPMERGE_RESULT_STORAGE=<block-type>/<block-name>``: that saved block's place and settings.
Records are small (URLs, fingerprints, reports): a stage costs a few KB of result storage.

Every record is written by `tasks.result_records.RecordSerializer` (JSON, never a pickle), and Prefect reads a
record back with the serializer the RECORD names. So the storage is never used as it is: whatever names it
(a URL, a slug, Prefect's default-block setting, the local default), `configured_result_storage` gives a
GUARDED block of the same place (`GUARDED_BLOCKS`: local folder, fsspec URL, ``S3Bucket``, ``GcsBucket``) whose
every read is `checked_record`: a record naming any other serializer (Prefect's pickle) is `UnsafeRecord`,
never loaded. Prefect only accepts result storage saved on the server, so the guarded block is saved
(``<guarded-type>/stepmerge-results-<hash>``) the first time a flow run asks for it; the flows apply it to every
stage task (`flows.stages`). A block of any other type is `UnguardedResultStorage` when the flow run starts.
A stage task run outside these flows (its own flow, Prefect's default storage) gets no cache key unless its
store is guarded (`is_guarded`, checked by `tasks.cache.StageCachePolicy`): it runs, and reads no record.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, TypeGuard

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem, NullFileSystem, RemoteFileSystem, WritableFileSystem

from merge_engine.errors import UnguardedResultStorage
from merge_engine.storage.schemes import backend_for_scheme, remote_schemes
from merge_engine.storage.urls import scheme_of
from tasks.result_records import checked_record

_SAVED: dict[tuple[str, str], WritableFileSystem] = {}


class GuardedReads(WritableFileSystem):
    """A result storage block's reads through `checked_record` (put first among a block class's bases: its
    methods override the storage's own ``read_path``, which Prefect calls)."""

    # Prefect declares ``read_path`` async on WritableFileSystem, yet each concrete block (the class after this one in
    # the MRO) dispatches it sync or async (``async_dispatch``, whose ``_sync`` keyword its signature omits) and
    # declares ``aread_path`` itself: the ignores below are for those declarations.
    async def aread_path(self, path: str) -> bytes:
        return checked_record(await super().aread_path(path), path)  # type: ignore[misc]  # declared by the block

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:  # type: ignore[override]  # as the concrete blocks' own read_path
        # the concrete block's read_path run sync, which returns bytes (Prefect types it as the abstract coroutine)
        stored: bytes = super().read_path(path, _sync=True)  # type: ignore[safe-super, call-arg, assignment]
        return checked_record(stored, path)


class GuardedLocalFileSystem(GuardedReads, LocalFileSystem):
    """Prefect's local result storage that reads only stepmerge's JSON records (`checked_record`)."""

    _block_type_name = "Guarded Local File System"


class GuardedRemoteFileSystem(GuardedReads, RemoteFileSystem):
    """Prefect's object-store result storage that reads only stepmerge's JSON records (`checked_record`)."""

    _block_type_name = "Guarded Remote File System"


GUARDED_BLOCKS: dict[type, type] = {LocalFileSystem: GuardedLocalFileSystem,
                                    RemoteFileSystem: GuardedRemoteFileSystem}

try:  # the ``blocks`` extra
    from prefect_aws import S3Bucket

    class GuardedS3Bucket(GuardedReads, S3Bucket):
        """An ``S3Bucket`` result storage that reads only stepmerge's JSON records (`checked_record`)."""

        _block_type_name = "Guarded S3 Bucket"

    GUARDED_BLOCKS[S3Bucket] = GuardedS3Bucket
except ImportError:  # pragma: no cover - without the extra no such block can be loaded either
    pass

try:
    from prefect_gcp import GcsBucket

    class GuardedGcsBucket(GuardedReads, GcsBucket):
        """A ``GcsBucket`` result storage that reads only stepmerge's JSON records (`checked_record`)."""

        _block_type_name = "Guarded GCS Bucket"

    GUARDED_BLOCKS[GcsBucket] = GuardedGcsBucket
except ImportError:  # pragma: no cover
    pass


def is_guarded(storage: object) -> TypeGuard[GuardedReads]:
    """Whether a result store's storage block reads only stepmerge's records (a `GuardedReads` block)."""
    return isinstance(storage, GuardedReads)


def guarded_block(block: object, slug: str) -> WritableFileSystem:
    """An (unsaved) guarded block of ``block``'s place and settings (``block`` itself when already guarded).

    Raises:
        UnguardedResultStorage: ``block``'s type is none of `GUARDED_BLOCKS` (a subclass is not either: its
            reads could be anything); ``slug`` names it.
    """
    if is_guarded(block):
        return block
    guarded = GUARDED_BLOCKS.get(type(block))
    if guarded is None or not isinstance(block, WritableFileSystem):
        raise UnguardedResultStorage(
            f"result storage {slug[:200]!r} is a {type(block).__name__[:100]} block: stepmerge reads results only "
            f"through blocks it can guard ({', '.join(sorted(t.__name__ for t in GUARDED_BLOCKS))})", slug[:200])
    return guarded(**{name: getattr(block, name) for name in type(block).model_fields})


def remote_result_storage(url: str) -> GuardedRemoteFileSystem:
    """An (unsaved) `GuardedRemoteFileSystem` block at an object-store URL (``s3://``, ``gs://``: any of the
    storage registry's `remote_schemes`), with the engine's client options for that store."""
    scheme = (scheme_of(url) or "") if "://" in url else ""  # case-insensitive: S3:// is s3://
    if scheme not in remote_schemes():
        raise ValueError(f"result storage must be a URL of an object store ({', '.join(remote_schemes())}), "
                         f"got {url[:200]!r}")
    settings: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False,
                                **backend_for_scheme(scheme).portable_options()}
    return GuardedRemoteFileSystem(basepath=url.rstrip("/") + "/", settings=settings)


def _unsaved_guarded(name: str) -> WritableFileSystem:
    """The guarded block for ``name``: an object-store URL (`remote_result_storage`), a saved block's slug
    (``<block-type>/<block-name>``: `guarded_block` of it) or an absolute local folder (`GuardedLocalFileSystem`)."""
    if "://" in name:
        return remote_result_storage(name)
    if Path(name).is_absolute():
        return GuardedLocalFileSystem(basepath=name)
    from prefect.blocks.core import Block

    loaded = Block.load(name, _sync=True)  # type: ignore[call-arg]  # async_dispatch's _sync, omitted by its signature
    return guarded_block(loaded, name)


def saved_result_storage(name: str) -> WritableFileSystem:
    """The guarded block for ``name`` (`_unsaved_guarded`) saved on the Prefect server (once per process, API and
    name; a block already guarded and saved is used as it is).

    Raises:
        UnguardedResultStorage: ``name`` is a saved block of a type that cannot be guarded.
    """
    from prefect.settings import PREFECT_API_URL

    key = (name, str(PREFECT_API_URL.value()))
    if key not in _SAVED:
        block = _unsaved_guarded(name)
        if getattr(block, "_block_document_id", None) is None:
            block.save(f"stepmerge-results-{hashlib.sha256(name.encode()).hexdigest()[:12]}", overwrite=True)
        _SAVED[key] = block
    return _SAVED[key]


def configured_result_storage() -> WritableFileSystem:
    """The guarded, saved result storage for the stage tasks: of ``STEPMERGE_RESULT_STORAGE`` (a URL or a saved
    block's slug), else of Prefect's ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``, else of the local folder
    ``PREFECT_RESULTS_LOCAL_STORAGE_PATH`` (module docstring).

    Call it inside a flow run (it may save a block on the server).

    Raises:
        UnguardedResultStorage: the storage named is a block of a type that cannot be guarded.
    """
    value = os.environ.get("STEPMERGE_RESULT_STORAGE", "").strip()
    if value:
        return saved_result_storage(value)
    from prefect.settings import get_current_settings

    results = get_current_settings().results
    if results.default_storage_block is not None:
        return saved_result_storage(str(results.default_storage_block))
    return saved_result_storage(str(Path(results.local_storage_path).expanduser().resolve()))


def reads_only_records(store: Any) -> bool:
    """Whether a Prefect result store reads its records only through a guarded block (no separate metadata
    storage, whose records would name their own serializer)."""
    metadata = getattr(store, "metadata_storage", None)
    return is_guarded(getattr(store, "result_storage", None)) and (metadata is None
                                                                  or isinstance(metadata, NullFileSystem))
