"""The weight files of a Hugging Face folder, read through the HF layout's reader, one check per stage.

`scan_weights` walks `merge_engine.layouts.hf`'s stages (`read_weight_index`, `open_weight_files`,
`tensors_by_name`) and turns each stage's named error into its failed check:
``weights_index`` (index readable, safe file names, files present), ``shard_headers`` (every header
parses: `merge_engine.formats.safetensors_file`), ``index_matches_shards`` (index and headers agree both
ways), then ``total_size`` (the index's declared size is the tensors' bytes). On success the
`FolderWeights` it returns reads tensors as a `TensorSource`; close it (or use ``with``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.errors import StepmergeError
from merge_engine.layouts import hf
from merge_engine.formats.safetensors_file import HeaderEntry, SafetensorsFile
from merge_engine.formats.tensor_source import TensorSource
from merge_engine.validate.report import Check

CHUNK_BYTES = 16 * 1024 * 1024  # bytes of one tensor read at a time (validation's reads)


class FolderWeights:
    """A folder's weights, opened: which file holds each tensor, header entries per file, and a source."""

    def __init__(self, url: str, files: Sequence[SafetensorsFile], source: TensorSource) -> None:
        self.url = url
        self.files = list(files)
        self.source = source
        self.entries: dict[str, HeaderEntry] = {}
        for handle in self.files:
            self.entries |= handle.entries()

    @property
    def names(self) -> set[str]:
        return set(self.entries)

    def entries_by_file(self) -> list[tuple[SafetensorsFile, dict[str, HeaderEntry]]]:
        """Each file (sorted by URL) with its entries in file order: for reading front to back."""
        return [(h, h.entries()) for h in sorted(self.files, key=lambda h: h.url)]

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> FolderWeights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def few(items: Sequence[Any], n: int = 5) -> str:
    """The first `n` items and how many more: keeps a check's detail one readable line."""
    return f"{list(items[:n])}" + (f" (+{len(items) - n} more)" if len(items) > n else "")


def scan_weights(url: str, listing: Mapping[str, storage.FileEntry]) -> tuple[list[Check], FolderWeights | None]:
    """The weight checks of the folder at ``url`` (``listing``: its top-level files by name) and, when
    the weights are usable, the opened `FolderWeights` (None otherwise; nothing left open then)."""
    files = list(listing.values())
    try:
        index = hf.read_weight_index(url, files)
    except StepmergeError as exc:
        return [Check("weights_index", False, exc.message)], None
    if index.indexed:
        count = sum(len(names) for names in index.files.values())
        checks = [Check("weights_index", True, f"{count} tensors in {len(index.files)} files")]
    else:
        checks = [Check("weights_index", True, f"single {next(iter(index.files))}")]

    try:
        opened = hf.open_weight_files(url, files, index)
    except (StepmergeError, OSError) as exc:
        return checks + [Check("shard_headers", False, str(exc))], None
    checks.append(Check("shard_headers", True, f"{len(opened)} files intact"))

    try:
        tensors = hf.tensors_by_name(index, opened)
    except StepmergeError as exc:
        for handle in opened:
            handle.close()
        return checks + [Check("index_matches_shards", False, str(exc))], None
    weights = FolderWeights(url, opened, hf.source_of(url, opened, tensors))
    if index.indexed:
        checks.append(Check("index_matches_shards", True))
        total = sum(e.end - e.start for e in weights.entries.values())
        declared = index.declared_total_size
        if declared is None:
            checks.append(Check("total_size", False, "index metadata has no total_size"))
        else:
            checks.append(Check("total_size", declared == total, f"{declared} declared, {total} bytes of tensors"))
    return checks, weights


def top_level_listing(url: str) -> dict[str, storage.FileEntry]:
    """The folder's top-level files by name (one listing)."""
    return {e.path: e for e in storage.list_files(url) if "/" not in e.path}
