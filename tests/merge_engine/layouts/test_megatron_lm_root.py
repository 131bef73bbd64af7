"""A Megatron-LM run root -> one iteration folder (`merge_engine.layouts.megatron_lm_root`).

Specification: the tracker names the iteration (one without a checkpoint: `IncompleteCheckpoint`
naming that folder); without a usable tracker (absent, "release", garbage) the only iteration is
chosen, and several are `UnsupportedLayout`; the listing comes back re-rooted in the iteration.
"""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.layouts.discovery import TRACKER_FILE
from merge_engine.errors import IncompleteCheckpoint, UnsupportedLayout
from merge_engine.layouts.megatron_lm_root import choose_iteration


def _run(tmp_path, iterations, tracker: bytes | None):
    for name in iterations:
        storage.write_bytes(str(tmp_path / name / ".metadata"), b"x")
    if tracker is not None:
        (tmp_path / TRACKER_FILE).write_bytes(tracker)
    return str(tmp_path), storage.list_files(str(tmp_path))


def test_tracker_chooses(tmp_path):
    url, files = _run(tmp_path, ["iter_0000010", "iter_0000020"], b"10\n")
    root, rebased = choose_iteration(url, files, ["iter_0000010", "iter_0000020"], holds=".metadata")
    assert root == str(tmp_path / "iter_0000010") and [f.path for f in rebased] == [".metadata"]


@pytest.mark.parametrize("tracker", [None, b"release", b"\xff\xfe"])
def test_without_a_usable_tracker_the_only_iteration(tmp_path, tracker):
    url, files = _run(tmp_path, ["iter_0000020"], tracker)
    assert choose_iteration(url, files, ["iter_0000020"], holds=".metadata")[0] == str(tmp_path / "iter_0000020")


def test_tracker_naming_a_missing_iteration_and_ambiguous_roots(tmp_path):
    url, files = _run(tmp_path, ["iter_0000010"], b"30")
    with pytest.raises(IncompleteCheckpoint, match="names iteration 30, which has no rank files") as info:
        choose_iteration(url, files, ["iter_0000010"], holds="rank files")
    assert info.value.path.endswith("iter_0000030")
    url, files = _run(tmp_path / "two", ["iter_0000010", "iter_0000020"], None)
    with pytest.raises(UnsupportedLayout, match="2 iterations here"):
        choose_iteration(url, files, ["iter_0000010", "iter_0000020"], holds=".metadata")
