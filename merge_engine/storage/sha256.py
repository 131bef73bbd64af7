"""`sha256_of`: the sha256 of a stored file, streamed with ranged reads (`HASH_CHUNK` of memory): the second
read a file costs when it was not hashed while written (`merge_engine.storage.hashing_writer`)."""

from __future__ import annotations

import hashlib

from merge_engine.storage.range_reader import RangeReader

HASH_CHUNK = 8 * 1024 * 1024

__all__ = ["HASH_CHUNK", "sha256_of"]


def sha256_of(url: str, size: int | None = None) -> str:
    """sha256 of one file, streamed with ranged reads (`HASH_CHUNK` of memory)."""
    digest = hashlib.sha256()
    with RangeReader(url, size) as reader:
        buffer = bytearray(min(HASH_CHUNK, reader.size) or 1)
        offset = 0
        while offset < reader.size:
            view = memoryview(buffer)[: min(len(buffer), reader.size - offset)]
            reader.read_into(offset, view)
            digest.update(view)
            offset += len(view)
    return digest.hexdigest()
