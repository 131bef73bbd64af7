"""URL spelling (`merge_engine.storage.urls`): joining untrusted parts, splitting schemes."""

from __future__ import annotations

import os

import pytest

from merge_engine import storage
from merge_engine.errors import UnsupportedScheme


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



class TestFileUrls:
    """Issue 17 point 6: ``file:`` URLs per RFC 8089. ``file://localhost/x`` used to write to
    ``/localhost/x``, ``file:/x`` to a relative folder named ``file:``, ``FILE:///x`` was a ValueError
    traceback; ``file://otherhost/x`` is another machine's file: a named error, nothing written."""

    def test_every_spelling_of_a_local_file_url_names_the_path(self, tmp_path):
        for spelling in (f"file://{tmp_path}/a", f"file://localhost{tmp_path}/a", f"file:{tmp_path}/a",
                         f"FILE://{tmp_path}/a", f"File://LocalHost{tmp_path}/a", f"file:///{tmp_path}/a",
                         f"local://{tmp_path}/a"):
            assert storage.split_scheme(spelling) == ("file", f"{tmp_path}/a"), spelling
            assert storage.is_local(spelling) and storage.local_path(spelling) == f"{tmp_path}/a"
            storage.write_bytes(storage.join(spelling, "x"), spelling.encode())
            assert (tmp_path / "a" / "x").read_bytes() == spelling.encode()
            assert [e.path for e in storage.list_files(spelling)] == ["x"]
        assert not os.path.exists(f"/localhost{tmp_path}") and not os.path.exists(os.path.abspath(f"file:{tmp_path}"))
        assert storage.split_scheme("S3://b/k") == ("s3", "b/k")

    @pytest.mark.parametrize("url", ["file://otherhost/x", "FILE://server.example/share/x", "file:relative/x", "file:"])
    def test_a_file_url_this_machine_cannot_read_is_a_named_error(self, url):
        from flows.url_checks import checked_url

        with pytest.raises(UnsupportedScheme) as info:
            storage.split_scheme(url)
        assert info.value.path == url and ("host" in info.value.message or "absolute path" in info.value.message)
        with pytest.raises(UnsupportedScheme):
            storage.write_bytes(url, b"never written")
        with pytest.raises(ValueError):
            checked_url(url)
        assert not os.path.exists("/otherhost") and not os.path.exists("/server.example")
