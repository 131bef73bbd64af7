"""Is a release (or a merged folder) still exactly what was published? `stepmerge verify URL`.

What is checked, against what:
- A release (a folder with ``manifest.json``): the ``_COMPLETE`` marker is present and holds
  this manifest's sha256; every file the manifest lists is there with its size and sha256; no
  file is there that the manifest does not list (claims under ``_PUBLISHING/`` excepted); and the release's own
  ``stepmerge.json``, when the manifest lists one, records every other file with the size and sha256 the
  manifest does (`provenance_disagreement`): rewriting a weight needs the manifest, the marker and the writer's
  record rewritten alike.
- A merged folder without a manifest (``stepmerge merge`` output): every file its ``stepmerge.json``
  lists is there with its size and the sha256 it records (``"sha256"``: the writer's, computed while
  writing), and nothing else is there. A ``stepmerge.json`` without a sha256 for every file it lists
  (written before they were recorded, or edited) cannot prove the bytes: the folder is
  UNVERIFIABLE (``unverifiable`` says why; not ok, exit 2), never "intact" on sizes alone.
- Only regular files are ever opened (`merge_engine.release.checksums`): a FIFO or device listed by a forged
  manifest is damage, not a hang.

Two costs (``mode``, `merge_engine.release.checksums`): ``"full"`` re-hashes every byte (the cost of
reading the release once; README "Verifying releases" has figures measured here); ``"quick"``
compares, on object stores, the store's version of each file recorded at publish time with one
listing (no byte read) and re-hashes local files.

`verify_folder` returns a `VerifyReport` (never raises for damage); `raise_for` turns it into the
named errors the CLI maps to exit codes: 0 intact, 3 `ReleaseIncomplete` (no valid marker), 6
`ReleaseDamaged` (each bad file named), 2 `InvalidConfig` (nothing to verify against, or no
checksums to verify with).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from merge_engine import storage
from merge_engine.release.checksums import MODES, RecordedFile, file_damage
from merge_engine.errors import InvalidConfig, ReleaseDamaged, ReleaseIncomplete
from merge_engine.output.target import PROVENANCE_FILE, read_provenance
from merge_engine.release.card import CARD
from merge_engine.release.folders import CLAIMS, MANIFEST, MARKER
from merge_engine.release.manifest import released_manifest


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
    unverifiable: str = ""  # why the bytes could not be checked (no checksums recorded); not ok

    @property
    def ok(self) -> bool:
        return self.marker_ok and not self.problems and not self.unverifiable

    def summary(self) -> str:
        if not self.marker_ok:
            return f"{self.url}: not a release readers may trust: no valid {MARKER} marker"
        if self.unverifiable and not self.problems:
            return f"{self.url}: UNVERIFIABLE: {self.unverifiable}"
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
        problems += provenance_disagreement(url, manifest.files, problems)
        return VerifyReport(url, "release", method, len(manifest.files), hashed, problems,
                            seconds=time.perf_counter() - started)
    provenance = read_provenance(url)
    if provenance is None or not isinstance(provenance.get("files"), dict):
        raise InvalidConfig(f"nothing to verify against: no {MANIFEST}, {MARKER} or {PROVENANCE_FILE} "
                            "(not a release or a stepmerge output)", url)
    sizes, sha256s = provenance["files"], provenance.get("sha256")
    sha256s = sha256s if isinstance(sha256s, dict) else {}
    unrecorded = sorted(name for name in sizes if not isinstance(sha256s.get(name), str))
    if unrecorded or not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes.values()):
        mismatches = [f"{name}: missing" for name in sorted(sizes) if name not in listing]
        mismatches += [f"{name}: {listing[name].size} bytes, {PROVENANCE_FILE} says {size}"
                       for name, size in sorted(sizes.items()) if name in listing and listing[name].size != size]
        why = (f"{PROVENANCE_FILE} records no sha256 for {len(unrecorded)} of its {len(sizes)} files "
               f"({', '.join(unrecorded[:3])}{', ...' if len(unrecorded) > 3 else ''}): sizes alone do not prove the bytes")
        return VerifyReport(url, "merged folder", "none", len(sizes), 0, tuple(mismatches),
                            seconds=time.perf_counter() - started, unverifiable=why)
    files = [_Recorded(name, size, sha256s[name]) for name, size in sorted(sizes.items())]
    problems, hashed, method = file_damage(url, files, listing, mode, ignored=(PROVENANCE_FILE,))
    return VerifyReport(url, "merged folder", method, len(files), hashed, problems,
                        seconds=time.perf_counter() - started)


def provenance_disagreement(url: str, files: Sequence[RecordedFile], problems: Sequence[str]) -> tuple[str, ...]:
    """One line per file whose size or sha256 in the release's manifest differs from what the release's own
    ``stepmerge.json`` (the writer's record, whose sha256 the manifest lists) records, or that only one of them
    lists; nothing when the manifest lists no ``stepmerge.json`` (a folder published without one) or when it is
    among ``problems`` already (damaged: its record is not read)."""
    damaged = any(problem.startswith(PROVENANCE_FILE + ":") for problem in problems)
    if damaged or not any(f.path == PROVENANCE_FILE for f in files):
        return ()
    provenance = read_provenance(url) or {}
    sizes, recorded = provenance.get("files"), provenance.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(recorded, dict):
        return (f"{PROVENANCE_FILE}: records no sha256 of the release's files",)
    # the model card is written by the publish, after the writer's record: only the manifest records its sha256
    listed = {f.path: f for f in files if f.path not in (PROVENANCE_FILE, CARD)}
    found = []
    for path in sorted(set(listed) | set(sizes)):
        entry = listed.get(path)
        if entry is None or sizes.get(path) != entry.size or recorded.get(path) != entry.sha256:
            found.append(f"{path}: the manifest and {PROVENANCE_FILE} record other bytes "
                         f"({'not in the manifest' if entry is None else 'size or sha256 differ'})")
    return tuple(found)


@dataclass(frozen=True)
class _Recorded:
    """A file as ``stepmerge.json`` records it (`merge_engine.release.checksums.RecordedFile`)."""

    path: str
    size: int
    sha256: str
    version: str = ""


def raise_for(report: VerifyReport) -> None:
    """`ReleaseIncomplete` (no valid marker), `ReleaseDamaged` (bad files) or `InvalidConfig` (no checksums
    to verify with), else nothing."""
    if not report.marker_ok:
        raise ReleaseIncomplete(f"no valid {MARKER} marker: not a release readers may trust", report.url)
    if report.problems:
        raise ReleaseDamaged(f"{len(report.problems)} bad file(s): " + "; ".join(report.problems), report.url)
    if report.unverifiable:
        raise InvalidConfig(f"cannot verify: {report.unverifiable}", report.url)


__all__ = ["MODES", "VerifyReport", "is_release_folder", "provenance_disagreement", "raise_for", "verify_folder"]
