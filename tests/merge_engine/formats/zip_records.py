"""Byte surgery on ``torch.save`` archives for tests: a record's bytes rewritten in place, its zip CRC-32
fixed (a valid archive of the same size holding other tensor bytes) or left stale (a bit flip that
only the CRC can tell)."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

__all__ = ["data_records", "flip_bit", "record_span", "rewrite_records"]


def data_records(archive: bytes) -> list[str]:
    """The names of the tensor storage records (``<archive>/data/<key>``), largest first."""
    infos = zipfile.ZipFile(io.BytesIO(archive)).infolist()
    records = [i for i in infos if "/data/" in i.filename and i.file_size > 0]
    return [i.filename for i in sorted(records, key=lambda i: -i.file_size)]


def record_span(archive: bytes, name: str) -> tuple[int, int]:
    """(start, end) of the record's data bytes in the archive."""
    info = zipfile.ZipFile(io.BytesIO(archive)).getinfo(name)
    name_len, extra_len = struct.unpack("<HH", archive[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


def rewrite_records(archive: bytes, change=lambda b: bytes(x ^ 0x01 for x in b), names=None) -> bytes:
    """Every data record (or ``names``) rewritten with ``change(bytes)`` (same length) and its CRC-32
    fixed in the local header and the central directory: a valid archive of the same size whose
    tensors hold other values."""
    out = bytearray(archive)
    zf = zipfile.ZipFile(io.BytesIO(archive))
    central = zf.start_dir
    for name in names or data_records(archive):
        start, end = record_span(archive, name)
        new = change(bytes(out[start:end]))
        assert len(new) == end - start
        out[start:end] = new
        crc = struct.pack("<I", zlib.crc32(new))
        info = zf.getinfo(name)
        out[info.header_offset + 14:info.header_offset + 18] = crc
        at = central
        while out[at:at + 4] == b"PK\x01\x02":
            n, e, c = struct.unpack("<HHH", out[at + 28:at + 34])
            if bytes(out[at + 46:at + 46 + n]).decode() == name:
                out[at + 16:at + 20] = crc
                break
            at += 46 + n + e + c
    return bytes(out)


def flip_bit(archive: bytes, name: str, bit: int) -> bytes:
    """One bit of the record's data flipped, its CRC-32 left as written (the damage only the CRC sees)."""
    start, end = record_span(archive, name)
    out = bytearray(archive)
    at = start + (bit // 8) % (end - start)
    out[at] ^= 1 << (bit % 8)
    return bytes(out)
