"""verl's Megatron checkpoint schema v2 (verl >= 0.9): ``model/{dist_ckpt,huggingface}``,
``optimizer/dist_ckpt``, ``extra/dist_ckpt`` and ``ckpt_contents.json``, which rank 0 writes LAST
(tmp + fsync + replace): the completeness marker of the whole step, whichever layout reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from merge_engine.layouts.contract import DONE, INCOMPLETE, Verdict
from merge_engine.storage import FileEntry

CONTENTS_MARKER = "ckpt_contents.json"
MODEL_DIST_DIR = "model/dist_ckpt/"
MODEL_HF_DIR = "model/huggingface/"


def marker_verdict(files: Sequence[FileEntry]) -> Verdict:
    """Complete exactly when ``ckpt_contents.json`` is listed."""
    if any(f.path == CONTENTS_MARKER for f in files):
        return DONE
    return Verdict(INCOMPLETE, f"{CONTENTS_MARKER} (written last) not present yet")
