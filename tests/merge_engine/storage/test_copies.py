"""`stage_in`, `copy_file` (`merge_engine.storage.copies`) against every backend and between every pair."""

from __future__ import annotations

import os

import pytest

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.storage import FileEntry
from tests.merge_engine.storage.patterned import patterned_bytes as _payload


class TestStageIn:
    def test_stages_every_file_and_verifies_it(self, storage_root, tmp_path, monkeypatch):
        monkeypatch.setattr(storage.tuning, "REMOTE_READ_CHUNK", 100)
        files = {"actor/model_world_size_2_rank_0.pt": _payload(1000, 1), "actor/model_world_size_2_rank_1.pt":
                 _payload(999, 2), "actor/huggingface/config.json": b"{}", "actor/empty": b""}
        for rel, data in files.items():
            storage.write_bytes(storage.join(storage_root, rel), data)
        entries = storage.list_files(storage_root)
        staged = storage.stage_in(storage_root, entries, str(tmp_path / "cache"), max_workers=2)
        assert sorted(staged) == sorted(files)
        for rel, path in staged.items():
            with open(path, "rb") as f:
                assert f.read() == files[rel]
        if storage.is_local(storage_root):
            assert staged["actor/empty"] == os.path.join(storage.local_path(storage_root), "actor", "empty")
        else:
            assert staged["actor/empty"].startswith(str(tmp_path / "cache"))

    def test_a_size_that_disagrees_with_the_listing_fails_and_stages_nothing(self, storage_root, tmp_path):
        storage.write_bytes(storage.join(storage_root, "a.pt"), b"x" * 10)
        cache = tmp_path / "cache"
        with pytest.raises(IncompleteCheckpoint):
            storage.stage_in(storage_root, [FileEntry("a.pt", 11, "v")], str(cache))
        assert not (cache / "a.pt").exists()
        with pytest.raises(IncompleteCheckpoint):
            storage.stage_in(storage_root, [FileEntry("gone.pt", 1, "v")], str(cache))

    def test_refuses_paths_that_leave_the_root(self, storage_root, tmp_path):
        with pytest.raises(ValueError):
            storage.stage_in(storage_root, [FileEntry("../escape", 1, "v")], str(tmp_path / "cache"))


@pytest.mark.parametrize("remote", ["s3", "gs"])
class TestStageInCache:
    def test_skips_files_already_staged_with_the_same_version(self, remote, request, tmp_path, monkeypatch):
        """A second stage-in of an unchanged listing downloads nothing; a rewritten file (same size,
        new version) is downloaded again, alone."""
        root = request.getfixturevalue(f"{'s3' if remote == 's3' else 'gcs'}_bucket_url") + "/step"
        storage.write_bytes(f"{root}/a.pt", b"a" * 50)
        storage.write_bytes(f"{root}/b.pt", b"b" * 50)
        cache = str(tmp_path / "cache")
        storage.stage_in(root, storage.list_files(root), cache)

        downloads: list[str] = []
        real_download = storage.copies._download

        def counting_download(src, dst, expected_size=None):
            downloads.append(src)
            return real_download(src, dst, expected_size)

        monkeypatch.setattr(storage.copies, "_download", counting_download)
        staged = storage.stage_in(root, storage.list_files(root), cache)
        assert downloads == []
        assert open(staged["a.pt"], "rb").read() == b"a" * 50

        storage.write_bytes(f"{root}/b.pt", b"B" * 50)
        staged = storage.stage_in(root, storage.list_files(root), cache)
        assert downloads == [f"{root}/b.pt"]
        assert open(staged["b.pt"], "rb").read() == b"B" * 50


BACKENDS = ("local", "file", "s3", "gs")


def _root(kind: str, request, tmp_path, name: str) -> str:
    if kind == "local":
        return str(tmp_path / name)
    if kind == "file":
        return f"file://{tmp_path / name}"
    fixture = "s3_bucket_url" if kind == "s3" else "gcs_bucket_url"
    return request.getfixturevalue(fixture) + f"/{name}"


@pytest.mark.parametrize("src_kind", BACKENDS)
@pytest.mark.parametrize("dst_kind", BACKENDS)
def test_copy_file_between_every_pair_of_backends(src_kind, dst_kind, request, tmp_path, monkeypatch):
    """Byte-exact copies in all 16 directions, streamed in chunks (a small chunk forces several)."""
    monkeypatch.setattr(storage.tuning, "REMOTE_READ_CHUNK", 4096)
    src = storage.join(_root(src_kind, request, tmp_path, "src"), "dir/weights.bin")
    dst = storage.join(_root(dst_kind, request, tmp_path, "dst"), "copied/weights.bin")
    data = _payload(10_000, seed=9)
    storage.write_bytes(src, data)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data
    assert [e.size for e in storage.list_files(dst.rsplit("/", 2)[0])] == [len(data)]
    with pytest.raises(FileNotFoundError):
        storage.copy_file(src + ".missing", dst + ".2")




UPLOAD_RSS = """
import sys
from merge_engine import storage
from merge_engine.storage import tuning
tuning.UPLOAD_PART, tuning.UPLOAD_PARTS_IN_FLIGHT = 5 * 1024 * 1024, 1  # S3's smallest part, one at a time
storage.write_bytes(sys.argv[2] + ".warm", b"x")  # the client and its connections exist before the baseline

def rss_kib(field):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(field)))

before = rss_kib("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # Linux: the peak (VmHWM) starts again from here
storage.copy_file(sys.argv[1], sys.argv[2])
print((rss_kib("VmHWM:") - before) // 1024)
"""


def test_an_upload_holds_a_bounded_number_of_parts(s3_bucket_url, tmp_path):
    """Publishing a staged file to S3 holds `UPLOAD_PARTS_IN_FLIGHT` parts, not s3fs's default ten of
    50 MiB per file (nor the whole file, which s3fs reads in one piece under 100 MiB): a 128 MiB file
    uploaded one 5 MiB part at a time raises the peak RSS by a few parts (s3fs's defaults: by the whole file).
    The copy is exact."""
    import subprocess
    import sys

    data = os.urandom(128 * 1024 * 1024 + 12345)
    source = tmp_path / "model.safetensors"
    source.write_bytes(data)
    target = f"{s3_bucket_url}/upload/model.safetensors"
    grown_mib = int(subprocess.run([sys.executable, "-c", UPLOAD_RSS, str(source), target], check=True,
                                   capture_output=True, text=True, env=dict(os.environ)).stdout.split()[-1])
    assert grown_mib < 64, f"peak RSS grew by {grown_mib} MiB while uploading"
    assert storage.read_bytes(target) == data
