"""Where a command's output goes: a folder at any URL that receives everything or nothing.

Shared by every command that writes a model or an adapter (`merge`, `extract-lora`,
`merge-lora`, `split`):
- `target_state`: "empty"; "same" when the folder's ``stepmerge.json`` records this very
  fingerprint and every file it lists is there with its size (the caller skips the work);
  "damaged" when the fingerprint matches but files are missing or resized (rebuilt in place: it is
  this command's own output); else `TargetExists` unless ``overwrite``;
- `write_target`: runs the writer into a sibling temp folder and renames it into place (local;
  temp folders of dead processes are swept), or writes in place behind a
  ``.stepmerge-partial.json`` marker and cleans up on failure (remote: a run killed mid-write
  leaves debris its retry recognises and rebuilds). ``stepmerge.json`` (provenance) is written
  last, so a folder with it is complete.
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
PARTIAL_FILE = ".stepmerge-partial.json"  # remote targets: written first, removed last

Files = list[tuple[str, int]]


def read_provenance(target_url: str) -> dict | None:
    """The target's ``stepmerge.json``, or None when absent or unreadable."""
    try:
        return json.loads(storage.read_text(storage.join(target_url, PROVENANCE_FILE)))
    except (FileNotFoundError, ValueError):
        return None


def target_state(target_url: str, fingerprint: str, overwrite: bool) -> str:
    """"empty", "same", "damaged" or "other" (only allowed with ``overwrite``); see the module docstring."""
    listing = {entry.path: entry.size for entry in storage.list_files(target_url)}
    if not listing:
        return "empty"
    provenance = read_provenance(target_url)
    if provenance and provenance.get("fingerprint") == fingerprint:
        recorded = provenance.get("files")
        if isinstance(recorded, dict) and all(listing.get(name) == size for name, size in recorded.items()):
            return "same"
        return "damaged"
    if provenance is None and _partial_fingerprint(target_url, listing) == fingerprint:
        return "damaged"  # debris of an interrupted run of this very command: rebuilt
    if not overwrite:
        raise TargetExists("target already holds other files; pass --overwrite to replace them", target_url)
    return "other"


def _partial_fingerprint(target_url: str, listing: Mapping[str, int]) -> str | None:
    if PARTIAL_FILE not in listing:
        return None
    try:
        return json.loads(storage.read_text(storage.join(target_url, PARTIAL_FILE))).get("fingerprint")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def write_target(target_url: str, state: str, write: Callable[[str], Files], provenance: Mapping[str, Any]) -> Files:
    """Run ``write(url)`` so that the target holds its whole output or nothing, then ``stepmerge.json``."""

    def write_all(url: str) -> Files:
        files = list(write(url))
        record = {**provenance, "files": {name: size for name, size in files}}
        data = (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()
        storage.write_bytes(storage.join(url, PROVENANCE_FILE), data)
        files.append((PROVENANCE_FILE, len(data)))
        return files

    if storage.is_local(target_url):
        return _write_local(storage.local_path(target_url).rstrip(os.sep), state, write_all)
    if state in ("other", "damaged"):
        storage.remove(target_url, recursive=True)
    marker = storage.join(target_url, PARTIAL_FILE)
    storage.write_bytes(marker, json.dumps({"fingerprint": provenance.get("fingerprint")}).encode())
    try:
        files = write_all(target_url)
    except BaseException:
        storage.remove(target_url, recursive=True)
        raise
    storage.remove(marker)
    return files


def _write_local(target: str, state: str, write_all: Callable[[str], Files]) -> Files:
    """Into a sibling temp folder named after this process, renamed into place at the end. Siblings left
    by processes that died (SIGKILL, out of memory) are swept first."""
    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    prefix = f".{os.path.basename(target)}.stepmerge-"
    for name in os.listdir(parent):
        if name.startswith(prefix) and not _process_alive(name[len(prefix):].split("-")[0]):
            storage.remove(os.path.join(parent, name), recursive=True)
    tmp = os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        files = write_all(tmp)
        if os.path.exists(target) and state != "same":  # "empty" may still hold empty folders
            storage.remove(target, recursive=True)
        os.replace(tmp, target)
    finally:
        storage.remove(tmp, recursive=True)
    return files


def _process_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except ValueError:
        return False  # not a name this module writes: an older layout's leftover
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True
