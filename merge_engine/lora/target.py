"""Results of the adapter commands; their targets follow `merge_engine.output_target`.

The fingerprint is the listing digest of every input folder plus the options and engine version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from merge_engine import __version__, storage
from merge_engine.lora.svd import ModuleReport
from merge_engine.output_target import read_provenance


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


NOT_OUTPUT_OPTIONS = ("overwrite", "chunk_bytes", "device")  # how to run, not what is written


def output_options(options: Any) -> dict[str, Any]:
    """An options dataclass without the fields that cannot change the output (fingerprints, provenance)."""
    return {k: v for k, v in asdict(options).items() if k not in NOT_OUTPUT_OPTIONS}


def inputs_fingerprint(inputs: Mapping[str, str], **options: Any) -> str:
    """Digest of each input folder's listing (role -> URL), the options and the engine version."""
    digests = {role: storage.fingerprint(storage.list_files(url)) for role, url in inputs.items()}
    return storage.fingerprint([], inputs=digests, engine=__version__, **options)


def skipped_result(target_url: str, kind: str, fingerprint: str, started: float) -> LoraResult:
    provenance = read_provenance(target_url) or {}
    return LoraResult(target_url, kind, fingerprint, int(provenance.get("tensors", 0)),
                      int(provenance.get("tensor_bytes", 0)),
                      tuple((e.path, e.size) for e in storage.list_files(target_url)),
                      time.perf_counter() - started, skipped=True)


def module_reports_json(reports: Sequence[ModuleReport]) -> dict[str, dict[str, float]]:
    return {r.module: {"rank": r.rank, "relative_error": r.relative_error} for r in reports}
