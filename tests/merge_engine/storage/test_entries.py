"""`FileEntry` and `fingerprint` (`merge_engine.storage.entries`): the core of every cache key."""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.storage import FileEntry


class TestFingerprint:
    A = FileEntry("a.pt", 10, "v1")
    B = FileEntry("b/c.json", 3, "v2")

    def test_stable_whatever_the_order(self):
        assert storage.fingerprint([self.A, self.B], dtype="bf16", engine="1") == storage.fingerprint(
            [self.B, self.A], engine="1", dtype="bf16"
        )

    @pytest.mark.parametrize(
        "changed",
        [
            [FileEntry("a.pt", 11, "v1"), B],  # size
            [FileEntry("a.pt", 10, "v9"), B],  # version
            [FileEntry("A.pt", 10, "v1"), B],  # name
            [A],  # a file missing
            [A, B, FileEntry("d", 0, "v")],  # a file more
        ],
    )
    def test_sensitive_to_every_listing_field(self, changed):
        assert storage.fingerprint(changed, dtype="bf16") != storage.fingerprint([self.A, self.B], dtype="bf16")

    def test_sensitive_to_options(self):
        base = storage.fingerprint([self.A], dtype="bf16")
        assert storage.fingerprint([self.A], dtype="fp32") != base
        assert storage.fingerprint([self.A], dtype="bf16", validate=True) != base
        assert storage.fingerprint([self.A]) != base

    def test_entries_cannot_be_confused_by_separators(self):
        """Names with spaces or digits do not collide with size/version fields."""
        assert storage.fingerprint([FileEntry("a 1", 2, "3")]) != storage.fingerprint([FileEntry("a", 12, "3")])

