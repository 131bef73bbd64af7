"""A local copy of a folder for the libraries that only read local paths (transformers, PEFT)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence

from merge_engine import storage


@contextlib.contextmanager
def local_folder(url: str, only: Sequence[str] | None = None) -> Iterator[str]:
    """A local path holding the folder's files: a local folder as it is, a remote one staged into a
    temp dir (removed on exit). ``only``: stage just those top-level names (and top-level ``*.py``,
    a model's remote code)."""
    if storage.is_local(url):
        yield storage.local_path(url)
        return
    with tempfile.TemporaryDirectory(prefix="stepmerge-validate-") as tmp:
        entries = storage.list_files(url)
        if only is not None:
            entries = [e for e in entries if e.path in only or (e.path.endswith(".py") and "/" not in e.path)]
        storage.stage_in(url, entries, tmp)
        yield tmp
