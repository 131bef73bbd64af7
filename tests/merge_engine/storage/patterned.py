"""Deterministic test payloads for the storage tests (not all-zero, not periodic on powers of two)."""

MiB = 1024 * 1024


def patterned_bytes(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(n))
