"""Fingerprints and reports shared by the adapter commands; their targets follow `merge_engine.output.jobs`.

The fingerprint is the listing digest of every input folder plus the options and engine version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine import engine_identity, storage
from merge_engine.commands.input_folders import InputFolders
from merge_engine.lora.svd import ModuleReport


def inputs_fingerprint(inputs: Mapping[str, str], folders: InputFolders | None = None, **options: Any) -> str:
    """Digest of each input folder's whole listing (role -> URL; ``folders``: the job's listings), the options and
    the engine version."""
    folders = folders or InputFolders()
    digests = {role: folders.digest(url, recursive=True) for role, url in inputs.items()}
    return storage.fingerprint([], inputs=digests, **engine_identity(), **options)


def module_reports_json(reports: Sequence[ModuleReport]) -> dict[str, dict[str, float]]:
    return {r.module: {"rank": r.rank, "relative_error": r.relative_error} for r in reports}
