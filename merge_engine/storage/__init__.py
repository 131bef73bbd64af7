"""Storage at any URL: plain paths, ``file://``, ``s3://`` (s3fs), ``gs://`` (gcsfs), ``memory://``.

One backend per store (`backends/`: ``local``, ``s3``, ``gcs``, ``memory``) behind the functions
below; the scheme registry (`schemes`) is the one list of schemes served, and every URL check
asks it (the engine's `backend_for`, flow parameters, Prefect result storage, the webhook).
Adding a store is one file in `backends/` (see `backend.FsspecBackend`).

Contract:
- Every function takes URLs (or plain local paths) and returns URLs in the same scheme. A URL
  whose scheme no backend serves raises `UnsupportedScheme`.
- Listings carry size and a version: the ETag on S3, the generation on GCS, ``mtime_ns-inode``
  locally. That is what fingerprints, and hence every cache key, are made of. No listing reads a
  byte of content, and no listing is ever served from a cache: every call asks the server.
- Reads of weights are ranged (`RangeReader`): a local file is read with ``os.preadv`` into the
  caller's buffer (the kernel asked to read ahead), a remote one with ranged GETs of at most
  `tuning.REMOTE_READ_CHUNK` bytes. A missing or short file raises `IncompleteCheckpoint`.
- Writes stream (`open_write`), or come as numbered parts in any order (`open_parts`: local positioned
  writes, S3 multipart parts by number; None on stores that take bytes only in order), and are all-or-nothing: a local file appears under its name only
  when the writer is closed without error (temp name + rename); a remote object is committed by
  the server on close and an aborted writer uploads nothing.
- Transient faults (`is_transient`: resets, timeouts, throttling) are retried here, a few times
  with exponential backoff and jitter, on top of s3fs's / gcsfs's own retries, wherever a call
  can be repeated safely (listings, metadata, small reads and writes, each ranged GET, copies).
  Anything else is raised at once.
- Configuration comes from the environment: S3 endpoint from ``STEPMERGE_S3_ENDPOINT`` or
  ``AWS_ENDPOINT_URL``, credentials from the usual AWS variables; a GCS emulator from
  ``STORAGE_EMULATOR_HOST`` (then anonymous); ``STEPMERGE_STORAGE_TIMEOUT`` (seconds) bounds
  connecting and each socket read (a stalled server), on S3 and GCS. A filesystem object is
  reused only while those variables stay the same. Tunables (chunk size, attempts, backoff,
  read-ahead) live in `tuning`, read at run time.

Modules: `urls` (spelling), `entries` (`FileEntry`, `fingerprint`), `tuning`, `faults` (the
classification chain, `retrying`; a persistent fault becomes `StorageUnavailable`), `backend` (the
backend contract and the fsspec body), `backends/` (one per store, each with its client's faults),
`schemes` (the registry; `is_transient` over every backend), `files` (listings, metadata, small
reads and writes), `range_reader`, `read_ahead`, `body` (a ranged GET's pieces, copied once),
`atomic_writer`, `copies` (`copy_file`, `copy_tree`, `stage_in`), `sha256` (`sha256_of` a stored file),
`written` (`FileRecord`: a written file's record; `WriteCancelled`), `json_text` (the one guarded JSON parser:
bounded size, depth and numbers; every JSON stepmerge reads goes through it).
"""

from merge_engine.storage import tuning
from merge_engine.storage.atomic_writer import AtomicWriter, CommitOnExit, open_parts, open_write
from merge_engine.storage.backend import clear_filesystems
from merge_engine.storage.copies import STAGE_MANIFEST, copy_file, copy_tree, stage_in
from merge_engine.storage.entries import FileEntry, fingerprint
from merge_engine.storage.files import (
    abort_uploads, exists, filesystem, info, list_dirs, list_files, read_bytes, remove, size, write_bytes,
)
from merge_engine.storage.range_reader import RangeReader
from merge_engine.storage.schemes import backend_for, is_transient
from merge_engine.storage.urls import is_local, join, local_path, split_scheme

__all__ = [
    "STAGE_MANIFEST", "AtomicWriter", "abort_uploads", "CommitOnExit", "FileEntry", "RangeReader", "backend_for", "clear_filesystems",
    "copy_file", "copy_tree", "exists", "filesystem", "fingerprint", "info", "is_local", "is_transient",
    "join", "list_dirs", "list_files", "local_path", "open_parts", "open_write", "read_bytes", "read_text", "remove",
    "size", "split_scheme", "stage_in", "tuning", "write_bytes",
]


def read_text(url: str) -> str:
    """A whole (small) text file (UTF-8), read through this package's `read_bytes`: every whole-file
    read in stepmerge passes that one function, where tests count them."""
    return read_bytes(url).decode("utf-8")
