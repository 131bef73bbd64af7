"""Staging folders: names stable per release and fingerprint, and the sweep of stale ones of ours only."""

from __future__ import annotations

import os
import time

from merge_engine.release.staging import staging_url, sweep_stale_staging


class TestStaging:
    def test_names_are_stable_per_release_and_fingerprint(self, tmp_path):
        root = str(tmp_path)
        one = staging_url(root, "s3://b/r/actor/global_step_1", "ab" * 32)
        assert one == staging_url(root, "s3://b/r/actor/global_step_1", "ab" * 32)
        assert one != staging_url(root, "s3://b/r/actor/global_step_2", "ab" * 32)
        assert one != staging_url(root, "s3://b/r/actor/global_step_1", "cd" * 32)
        assert os.path.dirname(one) == root

    def test_sweep_removes_only_stale_folders_of_ours(self, tmp_path):
        root = str(tmp_path)
        old, fresh, kept = (staging_url(root, f"s3://b/r/{n}", "ab" * 32) for n in ("old", "fresh", "kept"))
        temp_sibling = os.path.join(root, f".{os.path.basename(old)}.stepmerge-1234")
        foreign = os.path.join(root, "my-notes")
        for folder in (old, fresh, kept, temp_sibling, foreign):
            os.makedirs(folder)
            with open(os.path.join(folder, "f"), "wb") as handle:
                handle.write(b"x")
        long_ago = time.time() - 7200
        for folder in (old, kept, temp_sibling, foreign):
            os.utime(os.path.join(folder, "f"), (long_ago, long_ago))
            os.utime(folder, (long_ago, long_ago))

        removed = sweep_stale_staging(root, keep=kept, stale_s=3600)
        assert sorted(removed) == sorted([old, temp_sibling])
        assert {os.path.exists(p) for p in (fresh, kept, foreign)} == {True}
        assert sweep_stale_staging("s3://bucket/staging", stale_s=0) == []  # remote roots are left alone
