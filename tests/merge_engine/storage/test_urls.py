"""URL spelling (`merge_engine.storage.urls`): joining untrusted parts, splitting schemes."""

from __future__ import annotations

import os

import pytest

from merge_engine import storage


class TestPaths:
    @pytest.mark.parametrize("base", ["/tmp/run", "file:///tmp/run", "s3://bucket/run", "gs://bucket/run/"])
    @pytest.mark.parametrize("part", ["..", "../x", "a/../../b", "a/..", "/etc/passwd", "a\\..\\b"])
    def test_join_refuses_to_leave_the_base(self, base, part):
        with pytest.raises(ValueError):
            storage.join(base, part)

    def test_join(self):
        assert storage.join("s3://b/run/", "global_step_1", "actor/x.pt") == "s3://b/run/global_step_1/actor/x.pt"
        assert storage.join("gs://b", "a..b") == "gs://b/a..b"
        assert storage.join("/tmp/run", "a/b") == "/tmp/run/a/b"

    def test_split_scheme(self):
        assert storage.split_scheme("s3://b/k") == ("s3", "b/k")
        assert storage.split_scheme("file:///tmp/x") == ("file", "/tmp/x")
        assert storage.split_scheme("relative/x") == ("file", os.path.abspath("relative/x"))

