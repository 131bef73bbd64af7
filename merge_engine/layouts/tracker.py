"""``latest_checkpointed_iteration.txt``: the tracker file Megatron-LM (and verl) write at a run root.

It holds the number of the last saved step. verl writes it in place, not atomically, and not at all
under async save: it is a hint (discovery) or a choice among iterations (`megatron_lm_root`), never
the proof that a step exists.
"""

from __future__ import annotations

from merge_engine import storage

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def parse_tracker(text: str) -> int | None:
    """The step number in a tracker file (ASCII digits), or None when it is empty, partial or not a number."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def read_tracker_hint(run_root_url: str) -> int | None:
    """The number in ``latest_checkpointed_iteration.txt``; None when absent or unreadable."""
    try:
        return parse_tracker(storage.read_text(storage.join(run_root_url, TRACKER_FILE)))
    except (FileNotFoundError, UnicodeDecodeError):
        return None
