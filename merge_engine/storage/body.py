"""`Body`: the bytes of one ranged GET in the pieces the network delivered, copied once, into the reader's buffer.

aiohttp hands a response body over in the pieces it received (up to 256 KiB each). Joining them into
one `bytes` copies every byte once more before the reader copies it into its own buffer. A `Body` keeps the pieces, and `copy_range` copies any range of a
body (a `Body`, `bytes` or `bytearray`) straight into the caller's buffer.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["Body", "copy_range", "is_body"]


class Body:
    """Pieces of bytes in order; ``len()`` is their total. Immutable once built."""

    __slots__ = ("_pieces", "_starts", "_size")

    def __init__(self, pieces: Sequence[bytes | bytearray]) -> None:
        self._pieces = [p for p in pieces if len(p)]
        self._starts = []
        size = 0
        for piece in self._pieces:
            self._starts.append(size)
            size += len(piece)
        self._size = size

    def __len__(self) -> int:
        return self._size

    def copy_into(self, start: int, stop: int, out: memoryview) -> None:
        """Bytes ``[start, stop)`` of the body into ``out[:stop - start]`` (0 <= start <= stop <= len)."""
        if not 0 <= start <= stop <= self._size:
            raise ValueError(f"range {start}-{stop} outside a body of {self._size} bytes")
        index = bisect_right(self._starts, start) - 1
        at = 0
        while start < stop:
            piece, base = self._pieces[index], self._starts[index]
            lo, hi = start - base, min(len(piece), stop - base)
            out[at:at + hi - lo] = memoryview(piece)[lo:hi]
            at += hi - lo
            start = base + hi
            index += 1


def is_body(data: object) -> bool:
    """Whether ``data`` is what a ranged read may return: `bytes`, `bytearray` or a `Body`."""
    return isinstance(data, (bytes, bytearray, Body))


def copy_range(data: bytes | bytearray | Body, start: int, stop: int, out: memoryview) -> None:
    """Bytes ``[start, stop)`` of ``data`` into ``out[:stop - start]``: one copy, whatever ``data`` is."""
    if isinstance(data, Body):
        data.copy_into(start, stop, out)
    else:
        out[:stop - start] = memoryview(data)[start:stop]
