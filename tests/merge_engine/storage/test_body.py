"""`Body` (`merge_engine.storage.body`): a ranged GET's pieces, copied once into the reader's buffer.

Specification:
- any range of a body, across piece boundaries, empty pieces included, copies the same bytes as the
  joined body would give; a range outside the body is refused;
- `copy_range` gives the same for `bytes`, `bytearray` and `Body`;
- an S3 ranged GET of several MiB comes back from SeaweedFS in the pieces received (never joined),
  byte-exact.
"""

from __future__ import annotations

import asyncio

import pytest

from merge_engine import storage
from merge_engine.storage.body import Body, copy_range, is_body
from merge_engine.storage.schemes import backend_for
from tests.merge_engine.storage.patterned import MiB, patterned_bytes


def _bytes(body: Body) -> bytes:
    """All of ``body``'s bytes, read through its one reading method (`Body.copy_into`)."""
    out = bytearray(len(body))
    body.copy_into(0, len(body), memoryview(out))
    return bytes(out)


def test_every_range_across_pieces_is_the_joined_bytes():
    data = patterned_bytes(1000, seed=1)
    body = Body([data[:7], b"", data[7:300], data[300:301], data[301:]])
    assert len(body) == 1000 and _bytes(body) == data
    for start, stop in [(0, 0), (0, 1000), (5, 9), (7, 300), (6, 301), (299, 302), (300, 301), (999, 1000),
                        (1000, 1000), (123, 877)]:
        out = bytearray(b"\xff" * (stop - start + 3))
        body.copy_into(start, stop, memoryview(out))
        assert bytes(out[:stop - start]) == data[start:stop], (start, stop)
        assert out[stop - start:] == b"\xff" * 3  # nothing written past the range


@pytest.mark.parametrize("start, stop", [(-1, 3), (3, 2), (0, 1001)])
def test_a_range_outside_the_body_is_refused(start, stop):
    with pytest.raises(ValueError):
        Body([b"x" * 1000]).copy_into(start, stop, memoryview(bytearray(2000)))


def test_copy_range_is_the_same_for_every_kind_of_body():
    data = patterned_bytes(64, seed=2)
    for kind in (data, bytearray(data), Body([data[:10], data[10:]])):
        assert is_body(kind)
        out = bytearray(20)
        copy_range(kind, 5, 25, memoryview(out))
        assert bytes(out) == data[5:25]
    assert not is_body(memoryview(data)) and not is_body(None)


def test_an_s3_ranged_get_keeps_the_pieces_received(s3_bucket_url):
    url = storage.join(s3_bucket_url, "body.bin")
    data = patterned_bytes(MiB, seed=4) * 3
    storage.write_bytes(url, data)
    backend = backend_for(url)
    fs, path = backend.filesystem(url)
    got = asyncio.run_coroutine_threadsafe(
        backend.read_range(fs, path, MiB // 2, 3 * MiB - 5, None, url), fs.loop).result()
    assert isinstance(got, Body) and len(got._pieces) > 1  # several pieces: no join of the whole part
    assert _bytes(got) == data[MiB // 2:3 * MiB - 5]
