"""Where an adapter command's output goes: the same contract as `merge_engine.merge`.

- The target receives everything or nothing (local: a sibling temp folder renamed into place;
  remote: cleaned on failure), with ``stepmerge.json`` (provenance) written last.
- A target whose provenance has this fingerprint is left alone (``skipped``); one holding anything
  else raises `TargetExists` unless ``overwrite``.
- The fingerprint is the listing digest of every input folder plus the options and engine version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import __version__, storage
from merge_engine.errors import TargetExists
from merge_engine.lora.svd import ModuleReport
from merge_engine.merge import PROVENANCE_FILE, _target_state, _write_atomically, read_provenance


@dataclass(frozen=True)
class LoraResult:
    """What an adapter command wrote (``kind``: "adapter", "adapter+base" or "model")."""

    target_url: str
    kind: str
    fingerprint: str
    tensors: int
    tensor_bytes: int
    files: tuple[tuple[str, int], ...]
    seconds: float
    skipped: bool = False
    modules: tuple[ModuleReport, ...] = ()
    notes: tuple[str, ...] = ()


def inputs_fingerprint(inputs: Mapping[str, str], **options: Any) -> str:
    """Digest of each input folder's listing (role -> URL), the options and the engine version."""
    digests = {role: storage.fingerprint(storage.list_files(url)) for role, url in inputs.items()}
    return storage.fingerprint([], inputs=digests, engine=__version__, **options)


def target_state(target_url: str, fingerprint: str, overwrite: bool) -> str:
    """"empty", "same" (already holds this output) or "other" (only with ``overwrite``)."""
    state = _target_state(target_url, fingerprint)
    if state == "other" and not overwrite:
        raise TargetExists("target already holds other files; pass --overwrite to replace them", target_url)
    return state


def skipped_result(target_url: str, kind: str, fingerprint: str, started: float) -> LoraResult:
    provenance = read_provenance(target_url) or {}
    return LoraResult(target_url, kind, fingerprint, int(provenance.get("tensors", 0)),
                      int(provenance.get("tensor_bytes", 0)),
                      tuple((e.path, e.size) for e in storage.list_files(target_url)),
                      time.perf_counter() - started, skipped=True)


def write_target(target_url: str, state: str, write: Callable[[str], list[tuple[str, int]]],
                 provenance: Mapping[str, Any]) -> list[tuple[str, int]]:
    """Run ``write(url)`` atomically into the target, then add ``stepmerge.json``."""

    def write_all(url: str) -> list[tuple[str, int]]:
        files = list(write(url))
        data = (json.dumps(dict(provenance), indent=2, sort_keys=True, default=str) + "\n").encode()
        storage.write_bytes(storage.join(url, PROVENANCE_FILE), data)
        files.append((PROVENANCE_FILE, len(data)))
        return files

    return _write_atomically(target_url, replace=(state == "other"), write=write_all)


def module_reports_json(reports: Sequence[ModuleReport]) -> dict[str, dict[str, float]]:
    return {r.module: {"rank": r.rank, "relative_error": r.relative_error} for r in reports}
