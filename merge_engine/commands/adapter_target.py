"""Fingerprints and reports shared by the adapter commands; their targets follow `merge_engine.output.jobs`.

The fingerprint is the listing digest of every input folder plus the options and engine version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine import engine_identity, storage
from merge_engine.lora.svd import ModuleReport


def inputs_fingerprint(inputs: Mapping[str, str], **options: Any) -> str:
    """Digest of each input folder's listing (role -> URL), the options and the engine version."""
    digests = {role: storage.fingerprint(storage.list_files(url)) for role, url in inputs.items()}
    return storage.fingerprint([], inputs=digests, **engine_identity(), **options)


def module_reports_json(reports: Sequence[ModuleReport]) -> dict[str, dict[str, float]]:
    return {r.module: {"rank": r.rank, "relative_error": r.relative_error} for r in reports}
