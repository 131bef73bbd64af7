"""Where releases of a run live, and whether one is there, whole, and from the expected input.

Layout under a release root (default ``<run_root>/releases``; discovery ignores it, as it is no
``global_step_N`` folder)::

    <release_root>/<role or "model">/global_step_<N>/           the merged model of a step
    <release_root>/<role or "model">-adapter/global_step_<N>/   its LoRA adapter (LoRA runs)

Staging folders are local (``$STEPMERGE_STAGING_DIR``, else the system temp dir): the merge
writes there, validation reads there, publishing uploads once. A staging name is derived from the
release and the fingerprint, so a retry after a crash finds (and the engine reuses) a finished
merge. Publishing removes its staging folder (also when it refuses); a folder of ours that nobody
has written to for `STALE_STAGING_S` (a run killed mid-merge, or between merge and publish) is
removed by the next merge or extraction into the same staging root (`sweep_stale_staging`).

`release_state` decides, from the marker, the manifest and ONE listing (no weight is read),
whether a release is published, intact (every manifest file listed with its size) and built from
a given fingerprint. `published_releases` lists a release root once to say which steps are out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from merge_engine import storage
from merge_engine.errors import InvalidConfig
from merge_engine.publish import MARKER, Manifest, is_released, read_manifest

logger = logging.getLogger(__name__)

MODEL, ADAPTER = "model", "adapter"
KINDS = (MODEL, ADAPTER)
_RELEASE_MARKER = re.compile(r"^(?P<name>[^/]+)/global_step_(?P<step>\d+)/" + re.escape(MARKER) + "$")
# staging folders (`staging_url`) and the engine's temp siblings of them (`merge_engine.output_target`)
_STAGING_NAME = re.compile(r"^\.?[0-9a-f]{16}-[0-9a-f]{16}(\.stepmerge-.*)?$")
STALE_STAGING_S = float(os.environ.get("STEPMERGE_STALE_STAGING_S", str(6 * 3600)))


def default_release_root(run_root: str) -> str:
    return storage.join(run_root, "releases")


def release_folder_name(role: str, kind: str = MODEL) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    name = role or "model"
    return f"{name}-adapter" if kind == ADAPTER else name


def release_url(release_root: str, role: str, step: int, kind: str = MODEL) -> str:
    """``<release_root>/<role or model>[-adapter]/global_step_<step>``."""
    return storage.join(release_root, release_folder_name(role, kind), f"global_step_{int(step)}")


def default_staging_root() -> str:
    return os.environ.get("STEPMERGE_STAGING_DIR") or os.path.join(tempfile.gettempdir(), "stepmerge-staging")


def staging_url(staging_root: Optional[str], release: str, fingerprint: str) -> str:
    """A staging folder for one (release, fingerprint): stable across retries, distinct otherwise."""
    root = staging_root or default_staging_root()
    digest = hashlib.sha256(release.encode()).hexdigest()[:16]
    return storage.join(root, f"{digest}-{fingerprint[:16]}")


def _newest_mtime(path: str) -> float:
    newest = os.stat(path).st_mtime
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def sweep_stale_staging(staging_root: Optional[str], keep: str = "", stale_s: Optional[float] = None) -> list[str]:
    """Remove staging folders of ours under a LOCAL ``staging_root`` not written to for ``stale_s``
    (default `STALE_STAGING_S`), except ``keep``; only names `staging_url` (or the engine's temp
    siblings) give are touched. Returns the removed paths. Remote staging roots are left alone."""
    root = staging_root or default_staging_root()
    if not storage.is_local(root):
        return []
    root = storage.local_path(root)
    limit = time.time() - (STALE_STAGING_S if stale_s is None else stale_s)
    keep_name = os.path.basename(keep.rstrip("/")) if keep else ""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if name == keep_name or not _STAGING_NAME.match(name) or not os.path.isdir(path):
            continue
        try:
            if _newest_mtime(path) < limit:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                logger.info("removed stale staging folder %s", path)
        except FileNotFoundError:
            continue
    return removed


@dataclass(frozen=True)
class ReleaseState:
    """What is at a release URL: ``manifest`` when the marker vouches for one; ``intact`` when every
    file the manifest lists is present with its size; ``reason`` says what is wrong otherwise."""

    url: str
    manifest: Optional[Manifest]
    intact: bool
    reason: str = ""

    @property
    def released(self) -> bool:
        return self.manifest is not None

    def holds(self, fingerprint: str) -> bool:
        """Released, intact, and built from exactly this fingerprint."""
        return self.intact and self.manifest is not None and self.manifest.fingerprint == fingerprint


def release_state(url: str) -> ReleaseState:
    """Marker + manifest (two small reads) and one listing; never reads a weight."""
    if not is_released(url):
        return ReleaseState(url, None, False, "no valid _COMPLETE marker")
    try:
        manifest = read_manifest(url)
    except InvalidConfig as exc:
        return ReleaseState(url, None, False, str(exc))
    listed = {entry.path: entry.size for entry in storage.list_files(url)}
    damaged = [f.path for f in manifest.files if listed.get(f.path) != f.size]
    if damaged:
        return ReleaseState(url, manifest, False, f"{len(damaged)} files missing or resized, e.g. {damaged[0]}")
    return ReleaseState(url, manifest, True)


def published_releases(release_root: str) -> dict[tuple[str, int], str]:
    """(release folder name, step) -> URL of every release under ``release_root`` that readers trust.

    One recursive listing finds the markers; each is then confirmed (`is_released`: the marker
    matches its manifest). A folder without a marker, or with a stale one, is not published.
    """
    found: dict[tuple[str, int], str] = {}
    for entry in storage.list_files(release_root):
        match = _RELEASE_MARKER.match(entry.path)
        if not match:
            continue
        url = storage.join(release_root, match["name"], f"global_step_{match['step']}")
        if is_released(url):
            found[(match["name"], int(match["step"]))] = url
    return found
