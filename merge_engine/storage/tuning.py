"""The storage layer's tunables, in one place (tests and benchmarks change them here, at run time).

Every module reads these as ``tuning.NAME`` when it runs, never copies them at import, so a
change made here is seen everywhere at once.
"""

import os

REMOTE_READ_CHUNK = 32 * 1024 * 1024  # the largest ranged GET; ranged GETs are retried, whole-object reads are not
# Ranged GETs in flight per stream of forward reads of a remote file (`storage.read_ahead`), and per read
# that is not served ahead: object storage gives ~5 Gbps per connection and tens of Gbps per machine only
# with 32-64 requests in flight. STEPMERGE_REQUESTS_IN_FLIGHT (or `--requests-in-flight`) changes it; 1
# means one request at a time. More in flight never means smaller requests below MIN_RANGE_PART /
# read_ahead.MIN_PART_BYTES (1 MiB): the request count, and its CPU, stays that of the bytes read.
REQUESTS_IN_FLIGHT = int(os.environ.get("STEPMERGE_REQUESTS_IN_FLIGHT", "32"))
MIN_RANGE_PART = 1024 * 1024  # a smaller part costs a request (and its CPU: signing, parsing) for too few bytes
# Remote reads ahead of a reader that moves forward (`storage.read_ahead`): parts of READ_PART_BYTES (the
# 8-16 MB object stores recommend per ranged GET), up to REQUESTS_IN_FLIGHT per stream, all of a process's
# held parts within READ_AHEAD_BUDGET bytes (STEPMERGE_READ_AHEAD_BYTES); 0 turns read-ahead off.
READ_PART_BYTES = 8 * 1024 * 1024
READ_AHEAD_BUDGET = int(os.environ.get("STEPMERGE_READ_AHEAD_BYTES", str(256 * 1024 * 1024)))
# Uploads of local files (publishing a staged release, stage-out): parts of UPLOAD_PART bytes, at most
# UPLOAD_PARTS_IN_FLIGHT of them held and sent at once per file. s3fs's own defaults hold 10 parts of
# 50 MiB per file, and a whole file under 100 MiB: 8 files copied in parallel held ~9 GB here.
UPLOAD_PART = 16 * 1024 * 1024
UPLOAD_PARTS_IN_FLIGHT = 4
TRANSIENT_ATTEMPTS = 4  # attempts per retried call, on top of the storage library's own retries
BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 5.0
READ_AHEAD_BYTES = 64 * 1024 * 1024  # local reads: how far ahead of the reader the kernel is asked to fetch
DIRECT_IO_MIN_BYTES = 64 * 1024 * 1024  # local files at least this large bypass the page cache (direct_io)


def reload_from_env() -> None:
    """Read the tunables that come from the environment again (a worker process handed a coordinator's
    settings after it started: `merge_engine.output.executors.remote.apply_storage_env`)."""
    global REQUESTS_IN_FLIGHT, READ_AHEAD_BUDGET
    REQUESTS_IN_FLIGHT = int(os.environ.get("STEPMERGE_REQUESTS_IN_FLIGHT", "32"))
    READ_AHEAD_BUDGET = int(os.environ.get("STEPMERGE_READ_AHEAD_BYTES", str(256 * 1024 * 1024)))
