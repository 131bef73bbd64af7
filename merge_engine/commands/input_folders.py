"""The folders a job reads besides its checkpoint (``--base-model``, ``--hf_model_path``), each listed once per job.

A job (`merge_engine.commands.merge.MergeJob`, `merge_engine.commands.extract.ExtractJob`) holds one
`InputFolders`. Its fingerprint keys on each folder's listing, and everything after reads by that listing: the
weights are opened pinned to the listed versions, the metadata files copied are the listed ones, ``config.json`` is
read once. The fingerprint a release records is then of the very files the job read (a folder rewritten after the
fingerprint fails the read, it is not mixed in).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.formats.hf_metadata import copy_metadata, read_config
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.tensor_source import TensorSource


class InputFolders:
    """One job's input folders, by URL: listed (recursively) the first time asked, then from that listing."""

    def __init__(self) -> None:
        self._files: dict[str, list[FileEntry]] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self.left_out: list[str] = []  # each metadata file a copy left out, one line (which, why): the job's notes

    def files(self, url: str) -> list[FileEntry]:
        """Every file under ``url`` (paths relative to it), as the job's one listing of it saw them."""
        key = url.rstrip("/")
        if key not in self._files:
            self._files[key] = storage.list_files(url)
        return self._files[key]

    def top_level(self, url: str) -> list[FileEntry]:
        """The listed files directly in ``url`` (a model folder's own files)."""
        return [e for e in self.files(url) if "/" not in e.path]

    def digest(self, url: str, recursive: bool = False) -> str:
        """The fingerprint of the folder's listing: its top level only, or all of it."""
        return storage.fingerprint(self.files(url) if recursive else self.top_level(url))

    def config(self, url: str, what: str) -> dict[str, Any]:
        """The folder's ``config.json`` (`read_config`; ``what`` names the folder in an error), read once; each
        caller gets its own copy."""
        key = url.rstrip("/")
        if key not in self._configs:
            self._configs[key] = read_config(url, what=what)
        return copy.deepcopy(self._configs[key])

    def open(self, url: str) -> TensorSource:
        """The folder's tensors (`merge_engine.layouts.open_hf_folder`), from the job's listing."""
        from merge_engine.layouts import open_hf_folder

        return open_hf_folder(url, self.files(url))

    def copy_metadata(self, url: str, target_url: str, config: Mapping[str, Any],
                      updates: Mapping[str, Any] | None = None) -> list[tuple[str, int]]:
        """`copy_metadata` of the folder's listed top-level files; each file it leaves out is told in `left_out`."""
        return copy_metadata(url, target_url, config, updates, files=self.top_level(url),
                             on_left_out=self.left_out.append)
