"""Is a release (or a merged folder) still exactly what was published? `stepmerge verify URL`.

What is checked, against what:
- A release (a folder with ``manifest.json``): the ``_COMPLETE`` marker is present and vouches for
  this manifest (its sha256); every file the manifest lists is there with its size and sha256; no
  file is there that the manifest does not list (claims under ``_PUBLISHING/`` excepted).
- A merged folder without a manifest (``stepmerge merge`` output): every file its ``stepmerge.json``
  lists is there with its size. It records no checksums, so only sizes can be checked; the report
  says so (``method="sizes"``).

Two costs (``mode``, `merge_engine.checksums`): ``"full"`` re-hashes every byte (the cost of
reading the release once; README "Verifying releases" has figures measured here); ``"quick"``
compares, on object stores, the store's version of each file recorded at publish time with one
listing (no byte read) and re-hashes local files.

`verify_folder` returns a `VerifyReport` (never raises for damage); `raise_for` turns it into the
named errors the CLI maps to exit codes: 0 intact, 3 `ReleaseIncomplete` (no valid marker), 6
`ReleaseDamaged` (each bad file named), 2 `InvalidConfig` (nothing to verify against).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from merge_engine import storage
from merge_engine.checksums import MODES, file_damage
from merge_engine.errors import InvalidConfig, ReleaseDamaged, ReleaseIncomplete
from merge_engine.output_target import PROVENANCE_FILE, read_provenance
from merge_engine.release import CLAIMS, MANIFEST, MARKER, released_manifest


@dataclass(frozen=True)
class VerifyReport:
    """The verdict on one folder. ``problems``: one line per bad file (``path: what``)."""

    url: str
    kind: str  # "release" | "merged folder"
    method: str  # "sha256" | "store versions" | "store versions + sha256" | "sizes"
    files: int
    bytes_hashed: int
    problems: tuple[str, ...] = ()
    marker_ok: bool = True
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.marker_ok and not self.problems

    def summary(self) -> str:
        if not self.marker_ok:
            return f"{self.url}: not a release readers may trust: no valid {MARKER} marker"
        if self.problems:
            return f"{self.url}: DAMAGED, {len(self.problems)} bad file(s): " + "; ".join(self.problems)
        return (f"{self.url}: intact {self.kind}, {self.files} files checked by {self.method} "
                f"({self.bytes_hashed / 1e6:.1f} MB hashed in {self.seconds:.2f} s)")


def is_release_folder(url: str) -> bool:
    """Whether ``url`` holds a manifest or a marker (two small existence checks, no listing)."""
    return storage.exists(storage.join(url, MANIFEST)) or storage.exists(storage.join(url, MARKER))


def verify_folder(url: str, mode: str = "full") -> VerifyReport:
    """Verify a release or a merged folder (see the module docstring). `InvalidConfig` when there
    is neither ``manifest.json``, ``_COMPLETE`` nor ``stepmerge.json`` to verify against."""
    started = time.perf_counter()
    listing = {e.path: e for e in storage.list_files(url)}
    if MANIFEST in listing or MARKER in listing:
        manifest = released_manifest(url)
        if manifest is None:
            return VerifyReport(url, "release", "none", 0, 0, marker_ok=False,
                                seconds=time.perf_counter() - started)
        problems, hashed, method = file_damage(url, manifest.files, listing, mode, ignored=(MARKER, MANIFEST, CLAIMS))
        return VerifyReport(url, "release", method, len(manifest.files), hashed, problems,
                            seconds=time.perf_counter() - started)
    provenance = read_provenance(url)
    if provenance is None or not isinstance(provenance.get("files"), dict):
        raise InvalidConfig(f"nothing to verify against: no {MANIFEST}, {MARKER} or {PROVENANCE_FILE} "
                            "(not a release or a stepmerge output)", url)
    problems = []
    for name, size in sorted(provenance["files"].items()):
        entry = listing.get(name)
        if entry is None:
            problems.append(f"{name}: missing")
        elif entry.size != size:
            problems.append(f"{name}: {entry.size} bytes, {PROVENANCE_FILE} says {size}")
    known = set(provenance["files"]) | {PROVENANCE_FILE}
    problems += [f"{path}: not in {PROVENANCE_FILE}" for path in sorted(listing) if path not in known]
    return VerifyReport(url, "merged folder", "sizes", len(provenance["files"]), 0, tuple(problems),
                        seconds=time.perf_counter() - started)


def raise_for(report: VerifyReport) -> None:
    """`ReleaseIncomplete` (no valid marker) or `ReleaseDamaged` (bad files), else nothing."""
    if not report.marker_ok:
        raise ReleaseIncomplete(f"no valid {MARKER} marker: not a release readers may trust", report.url)
    if report.problems:
        raise ReleaseDamaged(f"{len(report.problems)} bad file(s): " + "; ".join(report.problems), report.url)


__all__ = ["MODES", "VerifyReport", "is_release_folder", "raise_for", "verify_folder"]
