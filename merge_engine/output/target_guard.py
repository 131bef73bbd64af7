"""Refusals that keep a command's output from destroying its own input or a file in its way.

Every command that writes a folder (`merge`, `split`, `extract-lora`, `merge-lora`, publishing)
replaces what is at its target (``--overwrite``, a damaged earlier output, a crashed run's
debris). Before anything is read or written:

- `refuse_overlap`: the target must not be the same location as any input, nor contain one, nor
  lie inside one (``--target_dir`` = the run root that holds ``--local_dir`` would otherwise
  delete the whole run). Locations are compared canonically: local paths by ``realpath`` (so a
  symlinked alias, ``file://`` URL, ``..`` or trailing slash changes nothing), remote URLs by
  the scheme registry's canonical scheme (``s3a``/``s3``, ``gcs``/``gs``) and normalised path. Raises `TargetOverlapsSource`.
- `refuse_non_folder_target`: a local target that exists but is not a folder (a regular file, a
  link, a device) is never deleted to make room for one unless ``overwrite`` is given: raises
  `TargetExists`.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable

from merge_engine import storage
from merge_engine.errors import TargetExists, TargetOverlapsSource

def canonical_location(url: str) -> tuple[str, str]:
    """``(scheme, normalised absolute path)`` naming the same place for every spelling of it."""
    scheme, path = storage.split_scheme(url)
    if scheme == "file":
        return "file", os.path.realpath(path)
    scheme = storage.backend_for(url).canonical_scheme  # the scheme registry knows the spellings
    normalised = posixpath.normpath("/" + path.replace("\\", "/")).lstrip("/") if path.strip("/") else ""
    return scheme, normalised.lstrip("/")


def _contains(outer: str, inner: str) -> bool:
    """Whether ``inner`` is ``outer`` or below it (path-component-wise: ``/a/b`` does not contain ``/a/bc``)."""
    if outer in ("", "/"):
        return True
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def overlaps(a: str, b: str) -> bool:
    """True when the locations are the same or one lies inside the other."""
    (scheme_a, path_a), (scheme_b, path_b) = canonical_location(a), canonical_location(b)
    return scheme_a == scheme_b and (_contains(path_a, path_b) or _contains(path_b, path_a))


def refuse_overlap(target_url: str, sources: Iterable[str | None]) -> None:
    """Raise `TargetOverlapsSource` (naming the target) if the target and any source overlap."""
    for source in sources:
        if source is None:
            continue
        if overlaps(target_url, source):
            if canonical_location(target_url) == canonical_location(source):
                how = "is the input itself"
            elif _contains(canonical_location(target_url)[1], canonical_location(source)[1]):
                how = "contains the input"
            else:
                how = "lies inside the input"
            raise TargetOverlapsSource(f"the target {how} ({source}); writing there would delete it: "
                                       "choose a target outside every input", target_url)


def refuse_non_folder_target(target_url: str, overwrite: bool) -> None:
    """A local target that exists as anything but a real folder is replaced only with ``overwrite``."""
    if not storage.is_local(target_url):
        return
    path = storage.local_path(target_url).rstrip(os.sep) or os.sep
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode) or overwrite:
        return
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "not a folder"
    raise TargetExists(f"target is {kind}; pass --overwrite to replace it with the output folder", target_url)


def check_target(target_url: str, sources: Iterable[str | None], overwrite: bool) -> None:
    """Both refusals, in order: the input is never at risk, then the thing in the target's way."""
    refuse_overlap(target_url, sources)
    refuse_non_folder_target(target_url, overwrite)


__all__ = ["canonical_location", "overlaps", "refuse_overlap", "refuse_non_folder_target", "check_target"]
