"""The storage layer's tunables, in one place (tests and benchmarks change them here, at run time).

Every module reads these as ``tuning.NAME`` when it runs, never copies them at import, so a
change made here is seen everywhere at once.
"""

REMOTE_READ_CHUNK = 32 * 1024 * 1024  # one ranged GET; ranged GETs are retried, whole-object reads are not
TRANSIENT_ATTEMPTS = 4  # attempts per retried call, on top of the storage library's own retries
BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 5.0
READ_AHEAD_BYTES = 64 * 1024 * 1024  # local reads: how far ahead of the reader the kernel is asked to fetch
DIRECT_IO_MIN_BYTES = 64 * 1024 * 1024  # local files at least this large bypass the page cache (direct_io)
