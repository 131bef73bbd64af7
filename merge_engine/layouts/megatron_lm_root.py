"""A Megatron-LM run root -> the one iteration folder to read (shared by the per-rank and torch_dist layouts).

Megatron-LM saves ``<run>/iter_NNNNNNN/`` folders and ``latest_checkpointed_iteration.txt`` (the
tracker, `merge_engine.layouts.tracker`). Contract of `choose_iteration`:

- the tracker, when listed and holding a number, names the iteration; one it names that holds no
  checkpoint is `IncompleteCheckpoint` (the save did not finish, or was pruned);
- without a usable tracker, the only iteration holding a checkpoint is chosen; several is
  `UnsupportedLayout` (point at one ``iter_*`` folder);
- the result is the iteration's URL and the listing re-rooted there (`rebase`).
"""

from __future__ import annotations

from collections.abc import Iterable

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, UnsupportedLayout
from merge_engine.layouts.runs import MEGATRON_LM
from merge_engine.layouts.tracker import TRACKER_FILE, read_tracker_hint
from merge_engine.storage import FileEntry


def rebase(files: list[FileEntry], prefix: str) -> list[FileEntry]:
    """The entries under ``prefix`` (a folder path ending in ``/``), with paths relative to it."""
    return [FileEntry(f.path[len(prefix):], f.size, f.version) for f in files if f.path.startswith(prefix)]


def choose_iteration(url: str, files: list[FileEntry], iterations: Iterable[str], holds: str
                     ) -> tuple[str, list[FileEntry]]:
    """(URL, re-rooted listing) of the iteration to read, among ``iterations`` (``iter_*`` folder
    names, no slash, each holding a checkpoint). ``holds`` names what a checkpoint folder holds
    (for the error when the tracker names an iteration without it)."""
    found = sorted(set(iterations))
    chosen = found[0] if len(found) == 1 else None
    number = read_tracker_hint(url) if any(f.path == TRACKER_FILE for f in files) else None
    if number is not None:
        chosen = MEGATRON_LM.folder(number)
        if chosen not in found:
            raise IncompleteCheckpoint(f"{TRACKER_FILE} names iteration {number}, which has no {holds}",
                                       storage.join(url, chosen))
    if chosen is None:
        raise UnsupportedLayout(f"{len(found)} iterations here ({', '.join(found)}) and no {TRACKER_FILE}; "
                                "point at one iter_* folder", url)
    return storage.join(url, chosen), rebase(files, chosen + "/")
