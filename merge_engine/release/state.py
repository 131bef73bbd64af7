"""What state a release is in, and what the pipeline asks it.

State (`release_state`: the marker and manifest, two small reads, ONE listing, and the checksums):

    ABSENT        nothing there
    IN_PROGRESS   files but no valid marker: a publisher at work, or debris of one that crashed
                  (readers ignore it; the next publish clears it)
    PUBLISHED     a valid marker, and every file the manifest lists is there with its size and
                  checksum (`merge_engine.release.checksums`, quick: object stores compare the store's
                  version recorded at publish time, no byte read; local files are re-hashed, the
                  cost of reading them once; a verdict is remembered a few minutes per process)
    DAMAGED       a valid marker, but files are missing, resized or hold other bytes (the pipeline
                  withdraws the marker, `withdraw_damaged`, and publishes again)

Readers trust only PUBLISHED folders. `published_releases` lists a release root once to say which
steps are out.

What the pipeline asks a `ReleaseState` (read once per flow run and output, then asked; `state_of` reuses
a state read earlier for the same URL): `released_output` (a build already published here, or
`TargetExists` for another one), `already_released` / `recorded_validation` (validate nothing: report what
the manifest recorded) and `is_current` (is a cached publication still the one here).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from merge_engine import storage
from merge_engine.errors import TargetExists
from merge_engine.release.built import BuiltOutput
from merge_engine.release.checksums import file_damage
from merge_engine.release.folders import MARKER, STEPS
from merge_engine.release.manifest import Manifest, is_released, released_manifest
from merge_engine.release.provenance import ReleaseProvenance

if TYPE_CHECKING:  # validate imports torch: for the type only
    from merge_engine.validate.report import ValidationReport

_RELEASE_MARKER = re.compile(r"^(?P<name>[^/]+)/(?P<folder>[^/]+)/" + re.escape(MARKER) + "$")

ABSENT, IN_PROGRESS, PUBLISHED, DAMAGED = "absent", "in_progress", "published", "damaged"


@dataclass(frozen=True)
class ReleaseState:
    """What is at a release URL (see the module docstring for ``status``): ``manifest`` when a valid
    marker holds its sha256; ``reason`` says what is wrong when not PUBLISHED."""

    url: str
    status: str
    manifest: Optional[Manifest] = None
    reason: str = ""

    @property
    def released(self) -> bool:
        """A valid marker is there (PUBLISHED or DAMAGED)."""
        return self.manifest is not None

    @property
    def intact(self) -> bool:
        return self.status == PUBLISHED

    @property
    def provenance(self) -> Optional[ReleaseProvenance]:
        return None if self.manifest is None else self.manifest.provenance

    def holds(self, fingerprint: str) -> bool:
        """Published, intact, and built from exactly this fingerprint."""
        return self.intact and self.manifest is not None and self.manifest.fingerprint == fingerprint

    def refuse_other(self, fingerprint: str, overwrite: bool, what: str = "output",
                     checkpoint_fingerprint: Optional[str] = None,
                     settings: Optional[Mapping[str, Any]] = None) -> None:
        """Raise `TargetExists` when this release is published from another fingerprint and not
        ``overwrite``: checked before a byte is read or staged (publishing would refuse it anyway,
        after the whole build).

        With ``checkpoint_fingerprint`` and ``settings`` (what this build would record), the message
        says which: the same checkpoint asked with other options names each differing option and
        offers a second release root (replacing the live release is not the fix for a second
        flavour of it); another checkpoint (the step was rewritten) offers ``overwrite``."""
        if not (self.intact and self.manifest is not None and self.manifest.fingerprint != fingerprint
                and not overwrite):
            return
        released = self.manifest.provenance
        if checkpoint_fingerprint is not None and released.checkpoint_fingerprint == checkpoint_fingerprint:
            differing = differing_options(released.settings, settings or {})
            named = "; ".join(f"{name}: {_shown(old)} there, {_shown(new)} asked" for name, old, new in differing)
            raise TargetExists(
                f"this step is already released here from the same checkpoint with other options "
                f"({named or 'options recorded differently'}): publish this {what} to a second release root "
                f"(the release_root parameter, e.g. {_second_root(self.url, differing)}); the live release stays "
                f"as it is (overwrite would replace it for every reader)", self.url)
        raise TargetExists(f"released from another checkpoint (fingerprint {self.manifest.fingerprint[:12]}…, this "
                           f"{what} would be {fingerprint[:12]}…; the step was rewritten since): pass overwrite to "
                           f"replace the release with the new checkpoint's {what}", self.url)


    # -- what the pipeline's stages ask (the state is read once per flow run and chain)

    def released_output(self, kind: str, source_url: str, fingerprint: str, *, overwrite: bool = False,
                        checkpoint_fingerprint: Optional[str] = None,
                        settings: Optional[Mapping[str, Any]] = None) -> Optional[BuiltOutput]:
        """The output this release already holds when it was built from ``fingerprint`` (nothing to build:
        ``released``, its counts from the release's ``stepmerge.json`` and manifest); else None.

        Raises `TargetExists` as `refuse_other` does (another build published here, not ``overwrite``)."""
        from merge_engine.output.target import read_provenance

        self.refuse_other(fingerprint, overwrite, kind, checkpoint_fingerprint, settings)
        if not self.holds(fingerprint) or self.manifest is None:
            return None
        provenance = read_provenance(self.url) or {}
        return BuiltOutput(kind=kind, source_url=source_url, url=self.url, fingerprint=fingerprint, release=self.url,
                           attempt=uuid.uuid4().hex, layout=str(provenance.get("layout", "")),
                           tensors=int(provenance.get("tensors", 0)),
                           tensor_bytes=int(provenance.get("tensor_bytes", 0)), files=len(self.manifest.files),
                           total_bytes=self.manifest.total_bytes, released=True)

    def already_released(self, output: BuiltOutput) -> bool:
        """Are ``output``'s bytes in this release and no longer to validate in staging: it was found released,
        or its staging folder is gone (a run before this one published it) and this release holds it?"""
        if output.released:
            return self.url == output.url
        # gone = no file listed: an emptied folder can stay listed as a prefix on S3 gateways (SeaweedFS)
        return self.url == output.release and not storage.list_files(output.url) and self.holds(output.fingerprint)

    def recorded_validation(self, output: BuiltOutput) -> Optional[ValidationReport]:
        """The validation this release's manifest recorded, when ``output`` is `already_released` here (None:
        validate ``output`` in staging). A manifest recording none gives a failed report saying so."""
        from merge_engine.validate.report import Check, ValidationReport

        if not self.already_released(output):
            return None
        recorded = dict(self.manifest.validation or {}) if self.manifest is not None else {}
        if not recorded:
            return ValidationReport(self.url, (Check("validation", False, "no validation recorded in the manifest"),))
        return ValidationReport.from_dict({"model_url": self.url, **recorded})

    def is_current(self, fingerprint: str, attempt: str) -> bool:
        """Is a publication recorded earlier (a cached `merge_engine.release.publish.Release`: its
        ``fingerprint`` and ``attempt``) still the one here: whole, from that fingerprint, same attempt?"""
        return self.holds(fingerprint) and self.manifest is not None and self.manifest.attempt == attempt


def _shown(value: Any) -> str:
    return "as stored" if value is None else str(value)


def differing_options(released: Mapping[str, Any], asked: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, released value, asked value) of every recorded option the two differ in (a size compared
    in bytes, so ``5GB`` and ``5000000000`` agree); options one side does not record are skipped."""
    from merge_engine.option_values import parse_size

    def same(name: str, a: Any, b: Any) -> bool:
        if name == "max_shard_size" and a is not None and b is not None:
            try:
                return parse_size(a) == parse_size(b)
            except Exception:  # noqa: BLE001 - an unreadable record differs
                return False
        return a == b

    return [(name, released[name], asked[name]) for name in sorted(set(released) & set(asked))
            if not same(name, released[name], asked[name])]


def _second_root(release: str, differing: list[tuple[str, Any, Any]]) -> str:
    """``<release root>-<asked value>``: the root three levels above ``release`` (role/step folders)."""
    root = release.rstrip("/").rsplit("/", 2)[0]
    suffix = "-".join(str(new) for _, _, new in differing[:2] if new is not None) or "other-options"
    return f"{root}-{suffix}"


def release_state(url: str) -> ReleaseState:
    """Marker + manifest (two small reads), one listing and the checksums (see the module docstring)."""
    manifest = released_manifest(url)
    listing = {entry.path: entry for entry in storage.list_files(url)}
    if manifest is None:
        if not listing:
            return ReleaseState(url, ABSENT, None, "nothing there")
        return ReleaseState(url, IN_PROGRESS, None, "no valid _COMPLETE marker")
    damaged = [f.path for f in manifest.files if f.path not in listing or listing[f.path].size != f.size]
    if damaged:
        return ReleaseState(url, DAMAGED, manifest, f"{len(damaged)} files missing or resized, e.g. {damaged[0]}")
    problems, _, _ = file_damage(url, manifest.files, listing, mode="quick", ignored=None)  # a flipped byte
    if problems:
        return ReleaseState(url, DAMAGED, manifest, f"{len(problems)} bad file(s), e.g. {problems[0]}")
    return ReleaseState(url, PUBLISHED, manifest)


def state_of(url: str, known: Optional[ReleaseState] = None) -> ReleaseState:
    """``known`` when it is the state of ``url`` (read earlier in the same flow run), else `release_state(url)`."""
    return known if known is not None and known.url == url else release_state(url)


def withdraw_damaged(state: ReleaseState) -> bool:
    """Remove the marker of a DAMAGED release, so readers stop trusting it and a publish clears and
    rewrites it (a marker-holding release with the same fingerprint would be returned as it is).
    Returns whether it did. ``state`` may be minutes old (read when a flow's chain began): the marker is
    withdrawn only if it is still the one that state read (same publish attempt), never a release another run
    has published since."""
    if state.status != DAMAGED or state.manifest is None:
        return False
    now = released_manifest(state.url)
    if now is None or now.attempt != state.manifest.attempt:
        return False
    storage.remove(storage.join(state.url, MARKER))
    return True


def published_releases(release_root: str) -> dict[tuple[str, int], str]:
    """(release folder name, step) -> URL of every release under ``release_root`` that readers trust.

    One recursive listing finds the markers; each is then confirmed (`is_released`: the marker
    matches its manifest). A folder without a marker, or with a stale one, is not published.
    """
    found: dict[tuple[str, int], str] = {}
    for entry in storage.list_files(release_root):
        match = _RELEASE_MARKER.match(entry.path)
        step = STEPS.step_of(match["folder"]) if match else None
        if match is None or step is None:
            continue
        url = storage.join(release_root, match["name"], STEPS.folder(step))
        if is_released(url):
            found[(match["name"], step)] = url
    return found
