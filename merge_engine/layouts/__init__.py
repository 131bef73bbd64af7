"""On-disk checkpoint formats. Each layout module provides the same three functions:

- ``detect(files) -> bool``: does this listing (relative `FileEntry` paths) look like the format?
- ``check_complete(url, files) -> Checkpoint``: every required file present, non-empty and
  readable (headers only); raises `IncompleteCheckpoint` / `WorldSizeMismatch` / `CorruptShard`.
- ``open(checkpoint) -> TensorSource``: the lazy full-tensor view the planner consumes.

`find_layout` tries them in `LAYOUTS` order; `check_checkpoint` and `open_checkpoint` are the
entry points the rest of the engine uses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, UnsupportedLayout
from merge_engine.storage import FileEntry
from merge_engine.tensor_source import TensorSource

# backend name (as on the command line) -> module, in detection order
LAYOUT_MODULES: dict[str, str] = {
    "fsdp": "merge_engine.layouts.fsdp",
    "megatron_legacy": "merge_engine.layouts.megatron_legacy",
    "megatron_bridge": "merge_engine.layouts.megatron_bridge",  # before megatron_dist: HF weights win
    "megatron_dist": "merge_engine.layouts.megatron_dist",
    "hf": "merge_engine.layouts.hf",
}
# backend names that stand for several layouts (verl's ``--backend megatron``), tried in this order
LAYOUT_ALIASES: dict[str, tuple[str, ...]] = {
    "megatron": ("megatron_legacy", "megatron_bridge", "megatron_dist"),
    "megatron_lm": ("megatron_legacy", "megatron_dist"),
}


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint, decided from its listing and headers: what the merge needs to start.

    ``parallel`` holds the parallel sizes (``world_size`` for FSDP; ``tp``/``pp``/... for Megatron),
    ``hf_dir`` the folder with config and tokenizer, ``fingerprint`` the listing's digest.
    """

    url: str
    layout: str
    files: tuple[FileEntry, ...]
    parallel: dict[str, int] = field(default_factory=dict, hash=False)
    hf_dir: str | None = None
    fingerprint: str = ""
    notes: tuple[str, ...] = ()


def layout_module(name: str) -> ModuleType:
    if name not in LAYOUT_MODULES:
        known = ", ".join([*LAYOUT_MODULES, *LAYOUT_ALIASES])
        raise UnsupportedLayout(f"unknown backend {name!r}; known: {known}")
    return importlib.import_module(LAYOUT_MODULES[name])


def find_layout(url: str, files: list[FileEntry]) -> ModuleType:
    for name in LAYOUT_MODULES:
        module = layout_module(name)
        if module.detect(files):
            return module
    if not files:
        raise IncompleteCheckpoint("no files found (missing or empty folder)", url)
    raise UnsupportedLayout(
        f"no known checkpoint layout in this folder ({len(files)} files, e.g. {files[0].path}); "
        f"known layouts: {', '.join(LAYOUT_MODULES)}", url)


def check_checkpoint(url: str, backend: str | None = None) -> Checkpoint:
    """List ``url`` once, pick the layout (or use ``backend``, a layout or an alias), check completeness."""
    files = storage.list_files(url)
    if not backend:
        return find_layout(url, files).check_complete(url, files)
    names = LAYOUT_ALIASES.get(backend, (backend,))
    if backend not in LAYOUT_ALIASES:
        layout_module(backend)  # an unknown name is refused before the listing is judged
    module = next((layout_module(n) for n in names if layout_module(n).detect(files)), None)
    if module is None:
        if not files:
            raise IncompleteCheckpoint("no files found (missing or empty folder)", url)
        raise UnsupportedLayout(f"this folder is not a {backend} checkpoint", url)
    return module.check_complete(url, files)


def open_checkpoint(checkpoint: Checkpoint) -> TensorSource:
    return layout_module(checkpoint.layout).open(checkpoint)
