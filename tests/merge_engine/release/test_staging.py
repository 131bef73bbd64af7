"""Staging folders: names stable per release and fingerprint, the checksums kept beside them, and the sweep of stale
ones of ours only (a kept folder's checksums kept with it)."""

from __future__ import annotations

import os
import time

from merge_engine.release.staging import (SUMS_SUFFIX, drop_checksums, keep_checksums, kept_checksums, staging_url,
                                          sweep_stale_staging)


class TestStaging:
    def test_names_are_stable_per_release_and_fingerprint(self, tmp_path):
        root = str(tmp_path)
        one = staging_url(root, "s3://b/r/actor/global_step_1", "ab" * 32)
        assert one == staging_url(root, "s3://b/r/actor/global_step_1", "ab" * 32)
        assert one != staging_url(root, "s3://b/r/actor/global_step_2", "ab" * 32)
        assert one != staging_url(root, "s3://b/r/actor/global_step_1", "cd" * 32)
        assert os.path.dirname(one) == root

    def test_checksums_are_kept_per_build_and_only_well_formed_ones_come_back(self, tmp_path):
        staging = staging_url(str(tmp_path), "s3://b/r/actor/global_step_1", "ab" * 32)
        sums = (("model.safetensors", "0" * 64), ("model.safetensors.index.json", "f" * 64))
        assert kept_checksums(staging, "ab" * 32) is None  # none kept
        keep_checksums(staging, "ab" * 32, sums)
        assert kept_checksums(staging, "ab" * 32) == sums
        assert kept_checksums(staging, "cd" * 32) is None  # of another build
        for forged in ('{"fingerprint": "%s", "checksums": [["a", "not-a-sha256"]]}' % ("ab" * 32), "[1, 2]", "{"):
            with open(staging + SUMS_SUFFIX + "/checksums.json", "w") as handle:
                handle.write(forged)
            assert kept_checksums(staging, "ab" * 32) is None
        drop_checksums(staging)
        assert not os.path.exists(staging + SUMS_SUFFIX)

    def test_a_sums_folder_or_file_there_as_a_link_is_refused_never_written_through(self, tmp_path):
        """A sums folder pre-created as a link (before: the checksums were written through it, into the folder it
        points to) or a sums file that is a link: `UnsafeFile`, nothing written there, nothing read from it."""
        import pytest

        from merge_engine.errors import UnsafeFile

        staging = str(tmp_path / ("ab" * 8 + "-" + "cd" * 8))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        os.symlink(elsewhere, staging + SUMS_SUFFIX)
        with pytest.raises(UnsafeFile) as error:
            keep_checksums(staging, "fp", (("model.safetensors", "a" * 64),))
        assert error.value.path == staging + SUMS_SUFFIX and not list(elsewhere.iterdir())
        (elsewhere / "checksums.json").write_text('{"fingerprint": "fp", "checksums": []}')
        with pytest.raises(UnsafeFile):
            kept_checksums(staging, "fp")
        os.remove(staging + SUMS_SUFFIX)
        os.mkdir(staging + SUMS_SUFFIX)
        os.symlink(elsewhere / "checksums.json", os.path.join(staging + SUMS_SUFFIX, "checksums.json"))
        with pytest.raises(UnsafeFile):
            kept_checksums(staging, "fp")

    def test_sweep_removes_only_stale_folders_of_ours(self, tmp_path):
        root = str(tmp_path)
        old, fresh, kept = (staging_url(root, f"s3://b/r/{n}", "ab" * 32) for n in ("old", "fresh", "kept"))
        temp_sibling = os.path.join(root, f".{os.path.basename(old)}.stepmerge-1234")
        foreign = os.path.join(root, "my-notes")
        old_sums, kept_sums = old + SUMS_SUFFIX, kept + SUMS_SUFFIX  # `keep_checksums`: with their folder
        for folder in (old, fresh, kept, temp_sibling, foreign, old_sums, kept_sums):
            os.makedirs(folder)
            with open(os.path.join(folder, "f"), "wb") as handle:
                handle.write(b"x")
        long_ago = time.time() - 7200
        for folder in (old, kept, temp_sibling, foreign, old_sums, kept_sums):
            os.utime(os.path.join(folder, "f"), (long_ago, long_ago))
            os.utime(folder, (long_ago, long_ago))

        removed = sweep_stale_staging(root, keep=kept, stale_s=3600)
        assert sorted(removed) == sorted([old, temp_sibling, old_sums])
        assert {os.path.exists(p) for p in (fresh, kept, foreign, kept_sums)} == {True}
        assert sweep_stale_staging("s3://bucket/staging", stale_s=0) == []  # remote roots are left alone
