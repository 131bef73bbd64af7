"""The CRC-32 of zip records checked as they are read, in pieces of any size and order (`RecordChecks`).

A merge reads a stored tensor's record in chunks, sometimes out of order (transposed views are
gathered in windows), sometimes only in part (FSDP2's padding behind a short shard, a fused tensor
split between two outputs). Each piece read is folded into the record's CRC with ``zlib.crc32`` in
the reading thread (it leaves the GIL on large buffers); pieces that meet are joined with
`crc32_combine` (zlib's, written here: Python's ``zlib`` does not expose it), so no byte is hashed
twice and nothing is held but (start, end, crc) per run of bytes read. When a record's runs cover
it whole, its CRC is compared with the zip directory's: a mismatch is `CorruptShard` naming the file
and the record. `RecordChecks.finish` reads what was left unread of the records begun (bounded
chunks) and checks them too: every record a job read from is then checked before its output counts.

Thread-safe: pieces of one record may arrive from several threads at once.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable

from merge_engine.errors import CorruptShard

__all__ = ["FINISH_CHUNK_BYTES", "RecordChecks", "crc32_combine"]

FINISH_CHUNK_BYTES = 16 * 1024 * 1024
_POLY = 0xEDB88320  # CRC-32 (zip), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected, as zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)``."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2) mod P, by squares
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


class _Record:
    __slots__ = ("crc", "runs", "size")

    def __init__(self, size: int, crc: int) -> None:
        self.size = size
        self.crc = crc
        self.runs: list[list[int]] = []  # sorted, disjoint, never adjacent: [start, end, crc]

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` no run covers yet."""
        out, at = [], start
        for run_start, run_end, _ in self.runs:
            if run_end <= at:
                continue
            if run_start >= end:
                break
            if run_start > at:
                out.append((at, run_start))
            at = max(at, run_end)
            if at >= end:
                break
        if at < end:
            out.append((at, end))
        return out

    def insert(self, start: int, end: int, crc: int) -> None:
        """Add a run known to be uncovered; join it with the runs it meets."""
        runs = self.runs
        at = 0
        while at < len(runs) and runs[at][1] <= start:
            at += 1
        runs.insert(at, [start, end, crc])
        if at + 1 < len(runs) and runs[at + 1][0] == end:
            nxt = runs.pop(at + 1)
            runs[at][1], runs[at][2] = nxt[1], crc32_combine(runs[at][2], nxt[2], nxt[1] - nxt[0])
        if at > 0 and runs[at - 1][1] == start:
            cur = runs.pop(at)
            prev = runs[at - 1]
            prev[1], prev[2] = cur[1], crc32_combine(prev[2], cur[2], cur[1] - cur[0])

    @property
    def whole(self) -> bool:
        return len(self.runs) == 1 and self.runs[0][0] == 0 and self.runs[0][1] == self.size


class RecordChecks:
    """The CRC-32 checks of one file's zip records (``url`` names the file in errors)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._open: dict[str, _Record] = {}
        self._checked: set[str] = set()

    def add(self, name: str, size: int, crc: int, offset: int, data: memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of record ``name`` (``size`` bytes, CRC-32 ``crc`` in the
        zip directory) were read: fold them in; `CorruptShard` when they complete a record whose
        CRC differs."""
        if name in self._checked or not len(data):
            return
        end = offset + len(data)
        with self._lock:
            record = self._open.get(name)
            if record is None:
                record = self._open[name] = _Record(size, crc)
            todo = record.gaps(offset, end)
        pieces = [(lo, hi, zlib.crc32(data[lo - offset:hi - offset])) for lo, hi in todo]
        with self._lock:
            if name in self._checked:
                return
            for lo, hi, piece_crc in pieces:
                for g_lo, g_hi in record.gaps(lo, hi):  # another thread may have covered part meanwhile
                    if (g_lo, g_hi) != (lo, hi):
                        piece_crc = zlib.crc32(data[g_lo - offset:g_hi - offset])
                    record.insert(g_lo, g_hi, piece_crc)
            if not record.whole:
                return
            del self._open[name]
            self._checked.add(name)
            got = record.runs[0][2]
        if got != crc:
            raise CorruptShard(f"zip record {name}: its bytes have CRC-32 {got:08x}, the archive says {crc:08x}: "
                               "the file is damaged", self.url)

    def pending(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Records begun but not read whole: their names and the byte ranges still unread."""
        with self._lock:
            return [(name, record.gaps(0, record.size)) for name, record in self._open.items()]

    def finish(self, read: Callable[[str, int, int], memoryview], describe: Callable[[str], tuple[int, int]]) -> None:
        """Read (``read(name, offset, length)``) what is left of every record begun and check it;
        ``describe(name)`` gives its (size, CRC-32). Raises `CorruptShard` like `add`."""
        for name, gaps in self.pending():
            size, crc = describe(name)
            for lo, hi in gaps:
                for at in range(lo, hi, FINISH_CHUNK_BYTES):
                    length = min(FINISH_CHUNK_BYTES, hi - at)
                    self.add(name, size, crc, at, read(name, at, length))

    @property
    def checked(self) -> frozenset[str]:
        """The records read whole and found intact."""
        with self._lock:
            return frozenset(self._checked)
