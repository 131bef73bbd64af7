"""`sha256_of`: a stored file's sha256 from ranged reads, whatever its size against the read chunk."""

from __future__ import annotations

import hashlib

import pytest

from merge_engine.storage import sha256


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 3 * 4096 + 5])
def test_sha256_of_is_hashlibs_over_any_number_of_chunks(tmp_path, monkeypatch, size):
    monkeypatch.setattr(sha256, "HASH_CHUNK", 4096)
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert sha256.sha256_of(str(path)) == hashlib.sha256(data).hexdigest()
    assert sha256.sha256_of(path.as_uri(), size) == hashlib.sha256(data).hexdigest()
