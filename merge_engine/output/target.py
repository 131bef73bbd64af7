"""Where a command's output goes: a folder at any URL that receives everything or nothing.

Shared by every command that writes a model or an adapter (`merge`, `extract-lora`,
`merge-lora`, `split`):
- `target_state`: "empty"; "same" when the folder's ``stepmerge.json`` records this very
  fingerprint and every file it lists is there with its size (the caller skips the work);
  "damaged" when the fingerprint matches but files are missing or resized (rebuilt in place: it is
  this command's own output); else `TargetExists` unless ``overwrite``;
- `write_target`: runs the writer into a live sibling temp folder and commits it whole, by an
  atomic swap with whatever is there (local; `merge_engine.output.local_commit`: temp folders of dead
  writers are swept by owner identity or heartbeat age, never by a pid alone), or writes in place behind a
  ``.stepmerge-partial.json`` marker and cleans up on failure or interrupt (remote: the files
  written, then the run's own unfinished multipart uploads, then the marker; a run killed outright
  leaves debris its retry recognises and clears the same way before it rebuilds). ``stepmerge.json``
  (provenance) is written last, so a folder with it is complete. SIGINT / SIGTERM
  (`merge_engine.output.interrupts`): every shard job stops, the cleanup runs whole, then `Interrupted`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from merge_engine import storage

from merge_engine.output import interrupts

from merge_engine.output import owner_record
from merge_engine.errors import StepmergeError, TargetExists
from merge_engine.output.local_commit import LiveFolder, commit_folder, sweep_dead_siblings
from merge_engine.output.target_guard import check_target
from merge_engine.storage.json_text import parse_json

PROVENANCE_FILE = "stepmerge.json"
PARTIAL_FILE = ".stepmerge-partial.json"  # remote targets: written first, removed last

Files = list[tuple[str, int]]


def read_provenance(target_url: str) -> dict | None:
    """The target's ``stepmerge.json``, or None when absent, unreadable or not a JSON object."""
    return _json_object(storage.join(target_url, PROVENANCE_FILE))


def target_state(target_url: str, fingerprint: str, overwrite: bool, *, sources: Sequence[str | None]) -> str:
    """"empty", "same", "damaged" or "other" (only allowed with ``overwrite``); see the module docstring.

    ``sources``: every input URL of the command. A target that overlaps one (`TargetOverlapsSource`)
    or is a local non-folder without ``overwrite`` (`TargetExists`) is refused first
    (`merge_engine.output.target_guard`)."""
    check_target(target_url, sources, overwrite)
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
    partial = _json_object(storage.join(target_url, PARTIAL_FILE))
    return partial.get("fingerprint") if partial else None


def _json_object(url: str) -> dict | None:
    """The JSON object in ``url``; None when absent or anything else (a file at the target holds no record)."""
    try:
        value = parse_json(storage.read_bytes(url), url)
    except (FileNotFoundError, NotADirectoryError, StepmergeError):
        return None
    return value if isinstance(value, dict) else None


def write_target(target_url: str, state: str, write: Callable[[str], Files], provenance: Mapping[str, Any]) -> Files:
    """Run ``write(url)`` so that the target holds its whole output or nothing, then ``stepmerge.json``.

    The write and its cleanup form one `interrupts.deferred` section: on SIGINT / SIGTERM the shard
    jobs stop, the cleanup runs whole, and `Interrupted` is raised after it (nothing is written then)."""

    def write_all(url: str) -> Files:
        files = list(write(url))
        interrupts.check()  # interrupted while the last jobs finished: no provenance, the cleanup runs
        record = {**provenance, "files": {name: size for name, size in files}}
        data = (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()
        storage.write_bytes(storage.join(url, PROVENANCE_FILE), data)
        files.append((PROVENANCE_FILE, len(data)))
        return files

    with interrupts.deferred():
        if storage.is_local(target_url):
            return _write_local(storage.local_path(target_url).rstrip(os.sep), state, write_all,
                                provenance.get("fingerprint"))
        return _write_remote(target_url, state, write_all, provenance.get("fingerprint"))


def _write_remote(target_url: str, state: str, write_all: Callable[[str], Files], fingerprint: str | None) -> Files:
    """In place, behind the partial marker (written first, removed last, the owner record of the
    unfinished write): a failure or an interrupt removes every file written and aborts the run's
    unfinished uploads (those begun since its marker) before the marker goes; a run killed outright
    leaves the marker, which the next run of the same command recognises (`target_state`:
    "damaged"), clearing the debris the same way before it writes."""
    marker = storage.join(target_url, PARTIAL_FILE)
    if state in ("other", "damaged"):
        debris = _json_object(marker)
        _clear_remote(target_url, own_marker=debris is not None and debris.get("fingerprint") == fingerprint)
    storage.write_bytes(marker, json.dumps(owner_record.new_record(fingerprint=fingerprint)).encode())
    try:
        files = write_all(target_url)
        interrupts.check()
    except BaseException:
        _clear_remote(target_url, own_marker=True)
        raise
    storage.remove(marker)
    return files


def _clear_remote(target_url: str, *, own_marker: bool) -> None:
    """Remove every file of the target, the partial marker last (a run killed meanwhile leaves it, so the
    next one finishes the job); with ``own_marker`` (the marker is this command's), first abort the
    multipart uploads under the target begun since the marker was written: stepmerge's own."""
    marker = storage.join(target_url, PARTIAL_FILE)
    if own_marker:
        try:
            storage.abort_uploads(target_url, not_before=marker)
        except FileNotFoundError:
            pass  # no marker after all: nothing begun under it
    for entry in storage.list_files(target_url):
        if entry.path != PARTIAL_FILE:
            storage.remove(storage.join(target_url, entry.path))
    storage.remove(marker)


def _write_local(target: str, state: str, write_all: Callable[[str], Files], fingerprint: str | None) -> Files:
    """Into a live temp sibling, committed whole at the end (`merge_engine.output.local_commit`: an atomic
    swap with whatever is there, so a kill at any instant leaves the whole old folder or the whole
    new one). Siblings of dead writers are swept first: by owner (same host, boot and PID namespace,
    process gone) or by heartbeat age, never by a pid alone. A concurrent writer that committed a
    DIFFERENT output meanwhile is not replaced without ``overwrite`` (`TargetExists`); one that
    committed this very output is swapped with ours (the same bytes: a clean outcome)."""
    sweep_dead_siblings(target)
    with LiveFolder(target) as tmp:
        files = write_all(tmp.path)
        interrupts.check()  # interrupted: the temp folder leaves with LiveFolder, nothing is committed
        if state != "other" and not _replaceable(target, fingerprint, state):
            raise TargetExists("another writer put a different output at the target meanwhile; pass --overwrite "
                               "to replace it", target)
        commit_folder(tmp.path, target)  # the old folder, if any, ends in tmp.path and leaves with it
    return files


def _replaceable(target: str, fingerprint: str | None, state: str) -> bool:
    if not os.path.lexists(target):
        return True
    provenance = read_provenance(target)
    if provenance is not None:
        return provenance.get("fingerprint") == fingerprint
    return state == "damaged" or not storage.list_files(target)  # our debris, or empty folders only
