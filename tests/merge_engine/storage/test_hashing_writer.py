"""The one hashing writer (`merge_engine.storage.hashing_writer.HashingWriter`).

Specification: hashed in ``write`` or in a thread of its own (``hash_queue``), the size and sha256 are
those of the bytes at the URL, locally and on ``s3://``; leaving the ``with`` block by an exception leaves
no file and no hashing thread.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from merge_engine import storage
from merge_engine.storage.hashing_writer import HashingWriter

PIECES = [b"header", bytes(range(256)) * 300, b"", memoryview(b"tail" * 1000)]


def _hashers() -> int:
    return sum(t.name == "stepmerge-hasher" for t in threading.enumerate())


@pytest.mark.parametrize("hash_queue", [0, 2])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_size_and_sha256_are_those_of_the_written_bytes(hash_queue, where, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket_url")
    url = storage.join(root, f"hashed-{hash_queue}.bin")
    before = _hashers()
    with HashingWriter(url, size_hint=sum(len(p) for p in PIECES), hash_queue=hash_queue) as out:
        for piece in PIECES:
            out.write(piece)
    data = storage.read_bytes(url)
    assert data == b"".join(bytes(p) for p in PIECES)
    assert (out.size, out.sha256()) == (len(data), hashlib.sha256(data).hexdigest())
    assert _hashers() == before


@pytest.mark.parametrize("hash_queue", [0, 2])
def test_an_error_leaves_no_file_and_no_thread(hash_queue, tmp_path):
    before = _hashers()
    with pytest.raises(RuntimeError):
        with HashingWriter(str(tmp_path / "x.bin"), hash_queue=hash_queue) as out:
            out.write(b"a" * 100_000)
            raise RuntimeError("the source failed")
    assert list(tmp_path.iterdir()) == []
    assert _hashers() == before
