"""Where a command's output goes: a folder at any URL that receives everything or nothing.

Shared by every command that writes a model or an adapter (`merge`, `extract-lora`,
`merge-lora`, `split`):
- `target_state`: "empty", or "same" when the folder's ``stepmerge.json`` records this very
  fingerprint (the caller skips the work), else `TargetExists` unless ``overwrite``;
- `write_target`: runs the writer into a sibling temp folder and renames it into place (local),
  or writes in place and cleans up on failure (remote); ``stepmerge.json`` (provenance) is
  written last, so a folder with it is complete.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from merge_engine import storage
from merge_engine.errors import TargetExists

PROVENANCE_FILE = "stepmerge.json"

Files = list[tuple[str, int]]


def read_provenance(target_url: str) -> dict | None:
    """The target's ``stepmerge.json``, or None when absent or unreadable."""
    try:
        return json.loads(storage.read_text(storage.join(target_url, PROVENANCE_FILE)))
    except (FileNotFoundError, ValueError):
        return None


def target_state(target_url: str, fingerprint: str, overwrite: bool) -> str:
    """"empty", "same" (already holds this output) or "other" (only allowed with ``overwrite``)."""
    if not storage.list_files(target_url):
        return "empty"
    provenance = read_provenance(target_url)
    if provenance and provenance.get("fingerprint") == fingerprint:
        return "same"
    if not overwrite:
        raise TargetExists("target already holds other files; pass --overwrite to replace them", target_url)
    return "other"


def write_target(target_url: str, state: str, write: Callable[[str], Files], provenance: Mapping[str, Any]) -> Files:
    """Run ``write(url)`` so that the target holds its whole output or nothing, then ``stepmerge.json``."""

    def write_all(url: str) -> Files:
        files = list(write(url))
        data = (json.dumps(dict(provenance), indent=2, sort_keys=True, default=str) + "\n").encode()
        storage.write_bytes(storage.join(url, PROVENANCE_FILE), data)
        files.append((PROVENANCE_FILE, len(data)))
        return files

    if storage.is_local(target_url):
        target = storage.local_path(target_url).rstrip(os.sep)
        parent = os.path.dirname(target) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(target)}.stepmerge-{uuid.uuid4().hex[:8]}")
        try:
            files = write_all(tmp)
            if os.path.exists(target) and (state == "other" or not os.listdir(target)):
                storage.remove(target, recursive=True)
            os.replace(tmp, target)
        finally:
            storage.remove(tmp, recursive=True)
        return files
    try:
        if state == "other":
            storage.remove(target_url, recursive=True)
        return write_all(target_url)
    except BaseException:
        storage.remove(target_url, recursive=True)
        raise
