"""Where releases live and the names inside a release folder: the one place the layout is spelled (`publish`
writes it, the flows and tasks ask here)::

    <run_root>/releases/                               default release root (`default_release_root`;
                                                       discovery ignores it: no global_step_N folder)
      <role or "model">/global_step_<N>/               the merged model of a step (`release_url`)
      <role or "model">-adapter/global_step_<N>/       its LoRA adapter (LoRA runs)
        ...the staged files...
        manifest.json                                  every file with size and sha256 (`merge_engine.release.manifest`)
        _COMPLETE                                      written last; holds the manifest's sha256
        _PUBLISHING/<attempt>.json                     claims of publishers at work (`merge_engine.release.publish`)
"""

from __future__ import annotations

from merge_engine import storage
from merge_engine.layouts.runs import VERL

RELEASES_DIR = "releases"
MODEL, ADAPTER = "model", "adapter"
KINDS = (MODEL, ADAPTER)
MARKER = "_COMPLETE"
MANIFEST = "manifest.json"
CLAIMS = "_PUBLISHING"
RESERVED = (MARKER, MANIFEST, CLAIMS)  # names a staged output may not use

STEPS = VERL  # a release folder's steps are named as verl names its step folders (`merge_engine.layouts.runs`)


def default_release_root(run_root: str) -> str:
    """``<run_root>/releases``."""
    return storage.join(run_root, RELEASES_DIR)


def release_folder_name(role: str, kind: str = MODEL) -> str:
    """``<role or "model">``, with ``-adapter`` for adapters."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    name = role or "model"
    return f"{name}-adapter" if kind == ADAPTER else name


def release_url(release_root: str, role: str, step: int, kind: str = MODEL) -> str:
    """``<release_root>/<role or model>[-adapter]/global_step_<step>``."""
    return storage.join(release_root, release_folder_name(role, kind), STEPS.folder(step))
