"""Staging folder -> release prefix, with a manifest of checksums and a commit marker written last.

The release's names (``manifest.json``, ``_COMPLETE``, ``_PUBLISHING/``: `merge_engine.release.folders`), its
records (`merge_engine.release.manifest.Manifest`) and how a reader tells its state (`is_released`,
`merge_engine.release.state.release_state`) are defined there; this module writes them.

Contract:
- `publish` copies every staged file to the release (sha256 computed while copying: each byte is
  read once), writes the model card ``README.md`` (`merge_engine.release.card`), then ``manifest.json``
  (files with size, sha256 and the store's version of each, source step URL and fingerprint, engine version,
  options, validation, created time), then ``_COMPLETE`` LAST. The marker holds the manifest's sha256, so a
  marker never matches another publisher's manifest. A LOCAL release is built in a live temp sibling and
  swapped into place whole (`merge_engine.output.local_commit`): no folder without its marker is ever visible
  at the release path, and a kill leaves the old release or the new one. An object-store release is
  written in place, marker last; its readers trust only the marker.
- What the release records names no path of this machine: the source and every path in the options and
  validation by `merge_engine.layouts.runs.portable_url` (its URL, or its path under the run root), the folder
  validated (a staging copy) as ``.``.
- ``checksums`` (the shard jobs' sha256 per staged weight file and index, computed while the merge
  wrote them: `merge_engine.output.jobs.OutputResult.checksums`): every file they name must be staged, the
  staging folder's ``stepmerge.json`` (the writer's record of every file it wrote: size and sha256) must record
  the same sha256 for them and record every other staged file too, and each copy must hash to what
  ``stepmerge.json`` records (`staged_sha256`), else `ChecksumMismatch` before the manifest is written (nothing
  published; staging removed with ``remove_staging``: it holds bytes the merge did not write). Without
  ``checksums``, a staged ``stepmerge.json`` is checked the same way. The manifest's sha256 are then the
  writer's, confirmed by the copy; only ``stepmerge.json`` itself is recorded as the copy hashed it.
- Staging holds regular files only: a link or special file in a local staging folder (or the folder a link) is
  `UnsafeFile` before anything is read (`merge_engine.release.staging.refuse_staged_links`; staging removed).
  What the staging disk must be trusted for: docs/publishing.md.
- The release must not overlap the staging folder or the source checkpoint (`InvalidOption`,
  `TargetOverlapsSource`): clearing it must never touch either.
- Readers trust a release only when `is_released`: the marker is there, parses, and matches the
  manifest. `merge_engine.release.verify.verify_folder` re-hashes every file against it.
- Idempotent: a released folder whose manifest has the same fingerprint and whose files are intact
  (`merge_engine.release.state.release_state`: sizes and checksums) -> nothing is copied and the existing
  release is returned (``already_published=True``); a damaged one is published again. A released folder with another
  fingerprint -> `TargetExists` unless ``overwrite``. A folder without a valid marker is junk from
  a crash: it is cleared and published again.
- A failed validation publishes nothing, removes the staging folder and raises `ValidationFailed`.
  On success (or when already published) the staging folder is removed too (``remove_staging``).

Concurrency (lock-free; the Prefect layer adds a lock on top): two publishers of one release never both
write. Each attempt writes its own claim ``_PUBLISHING/<attempt>.json`` (`claims_url`) and lists the claims:
it proceeds only when it sees no other live claim, else deletes its own and retries after a random, growing
delay, returning the winner's release when the marker appears. A claim names its publisher's process (dead
on this host: deleted at once) and carries a heartbeat refreshed every ``claim_ttl_s / 4`` (older than
``claim_ttl_s``: a crashed publisher's, ignored and deleted). An owner whose claim went stale or vanished
raises `ClaimLost` before the manifest; waiting past ``wait_s`` raises `ReleaseBusy` (both transient).
Why at most one proceeds, and why claims rather than "last marker wins": docs/publishing.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import random
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from merge_engine import storage

from merge_engine.output import owner_record
from merge_engine.output.clock import SYSTEM_CLOCK, Clock
from merge_engine.errors import (
    ChecksumMismatch, CorruptShard, InvalidOption, TargetExists, UnsafeFile, ValidationFailed,
)
from merge_engine.layouts.runs import portable_record, portable_url
from merge_engine.output.local_commit import LiveFolder, commit_folder, sweep_dead_siblings
from merge_engine.output.target import PROVENANCE_FILE, read_provenance
from merge_engine.release.card import CARD, card_facts, write_card
from merge_engine.release.folders import CLAIMS, MANIFEST, MARKER, RESERVED
from merge_engine.release.manifest import Manifest, ManifestFile, released_manifest, sha256_hex
from merge_engine.release.staging import refuse_staged_links
from merge_engine.release.state import release_state
from merge_engine.storage import FileEntry
from merge_engine.output.target_guard import overlaps, refuse_overlap
from merge_engine.validate import Check, ValidationReport

COPY_CHUNK = 8 * 1024 * 1024
CLAIM_TTL_S = 600.0


class ReleaseBusy(TimeoutError):
    """Another publisher holds the release for longer than we were willing to wait (transient)."""


class ClaimLost(ReleaseBusy):
    """Our claim vanished or went stale while we copied (we stalled past ``claim_ttl_s``, so another
    publisher may own the release now): the manifest and marker were not written (transient)."""


# --------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Release:
    """A published release: where, from what, how big; `already_published` when this call copied nothing."""

    url: str
    source: str
    fingerprint: str
    engine_version: str
    files: int
    total_bytes: int
    created: str
    attempt: str
    already_published: bool = False
    validation_ok: bool | None = field(default=None)

    @classmethod
    def from_manifest(cls, url: str, manifest: Manifest, already_published: bool) -> Release:
        ok = None if manifest.validation is None else bool(manifest.validation.get("ok"))
        return cls(url, manifest.source, manifest.fingerprint, manifest.engine_version, len(manifest.files),
                   manifest.total_bytes, manifest.created, manifest.attempt, already_published, ok)


def portable_validation(validation: ValidationReport) -> dict[str, Any]:
    """The validation record a manifest keeps: the report (with its Markdown ``summary``) naming the release
    itself as ``.`` (it ran on a staging copy), every path of this machine in it by its `portable_url`."""
    report = dataclasses.replace(validation, model_url=".", reference_url=None if validation.reference_url is None
                                 else portable_url(validation.reference_url))
    report = dataclasses.replace(report, checks=tuple(dataclasses.replace(c, detail=portable_record(c.detail))
                                                      for c in report.checks))
    return {**report.to_dict(), "summary": report.summary()}


# --------------------------------------------------------------------------------------------------
# Claims


def claims_url(release_url: str) -> str:
    """Where the claims on a release live: ``<release>/_PUBLISHING/`` on object stores; beside a
    local release (``.<name>.publishing/``), which must not exist before it is complete."""
    if storage.is_local(release_url):
        path = storage.local_path(release_url).rstrip(os.sep)
        return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.publishing")
    return storage.join(release_url, CLAIMS)


def _claim_url(release_url: str, attempt: str) -> str:
    return storage.join(claims_url(release_url), f"{attempt}.json")


def _write_claim(release_url: str, attempt: str, fingerprint: str, clock: Clock = SYSTEM_CLOCK) -> None:
    """A claim is an owner record (`merge_engine.output.owner_record`: host, boot, PID namespace, pid, start
    time, heartbeat), so a dead publisher on this host and namespace is recognised at once."""
    body = owner_record.new_record(clock.time(), attempt=attempt, fingerprint=fingerprint)
    storage.write_bytes(_claim_url(release_url, attempt), json.dumps(body).encode())


def _read_claim(release_url: str, attempt: str) -> dict[str, Any] | None:
    """Our claim's body, or None when it is gone (or unreadable: claims are written whole)."""
    try:
        return owner_record.read_record(storage.read_bytes(_claim_url(release_url, attempt)), None)
    except FileNotFoundError:
        return None


class _Heartbeat:
    """Keeps our claim live while in use: a daemon thread refreshes it every ``ttl_s / 4`` seconds.

    The claim was stale, and so may have been taken over, if ever ``ttl_s`` passed without a
    refresh (this process stalled, or storage failed that long): then `lost` is set and the thread
    stops. It refreshes only a claim that is still there: once another publisher has deleted ours,
    re-creating it would let two owners write. A failed refresh is retried at the next beat.
    `check` (before the manifest) raises `ClaimLost` if the claim is lost, gone or not ours.
    """

    def __init__(self, release_url: str, attempt: str, fingerprint: str, ttl_s: float, clock: Clock) -> None:
        self._args = (release_url, attempt, fingerprint)
        self._ttl_s = ttl_s
        self._clock = clock
        self._last_beat = clock.monotonic()  # the claim was written just before
        self._stop = threading.Event()
        self.lost = False
        self._thread = threading.Thread(target=self._run, name=f"publish-heartbeat-{attempt[:8]}", daemon=True)

    def _run(self) -> None:
        release_url, attempt, fingerprint = self._args
        while not self._clock.wait(self._stop, self._ttl_s / 4):
            if self._clock.monotonic() - self._last_beat > self._ttl_s:
                self.lost = True  # stale for a while: another publisher may have taken over
                return
            try:
                if _read_claim(release_url, attempt) is None:
                    self.lost = True
                    return
                beat = self._clock.monotonic()
                _write_claim(release_url, attempt, fingerprint, self._clock)
                self._last_beat = beat
            except Exception:  # noqa: BLE001 - a storage hiccup: the next beat retries
                continue

    def check(self) -> None:
        release_url, attempt, _ = self._args
        body = _read_claim(release_url, attempt)
        stale = self.lost or self._clock.monotonic() - self._last_beat > self._ttl_s
        if stale or body is None or body.get("attempt") != attempt:
            raise ClaimLost(f"our publishing claim on {release_url} is {'stale' if stale else 'gone'} (this publisher "
                            "stalled past the claim TTL; another may own the release): manifest and marker not written")

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def _remove_claim(release_url: str, attempt: str) -> None:
    storage.remove(_claim_url(release_url, attempt))
    if storage.is_local(release_url):  # object stores have no empty folders; a local one would linger
        try:
            os.rmdir(storage.local_path(claims_url(release_url)))
        except OSError:
            pass  # another publisher's claim is still there, or the folder is already gone


def _live_claims(release_url: str, ttl_s: float, clock: Clock = SYSTEM_CLOCK) -> list[str]:
    """Attempts holding a claim with a fresh heartbeat whose publisher is not certainly dead; the
    others are deleted on the way (a dead publisher on this host and PID namespace at once, one
    elsewhere once its heartbeat is older than ``ttl_s``, or more than ``ttl_s`` in the future; a
    malformed claim at once: `merge_engine.output.owner_record`)."""
    live = []
    for entry in storage.list_files(claims_url(release_url)):
        if "/" in entry.path or not entry.path.endswith(".json"):
            continue  # a claim exists from the moment its .json name does (local temp names don't count)
        url = storage.join(claims_url(release_url), entry.path)
        try:
            owner = owner_record.Owner.parse(owner_record.read_record(storage.read_bytes(url), url))
        except FileNotFoundError:
            continue  # released between the listing and the read
        if owner is None or owner.stale(clock.time(), ttl_s):  # claims are written whole: a malformed one is debris
            storage.remove(url)
            continue
        live.append(entry.path.removesuffix(".json"))
    return live


def _try_claim(release_url: str, attempt: str, fingerprint: str, ttl_s: float, clock: Clock) -> bool:
    """Write our claim, then look: own the release only if no other live claim is there."""
    _write_claim(release_url, attempt, fingerprint, clock)
    if any(other != attempt for other in _live_claims(release_url, ttl_s, clock)):
        _remove_claim(release_url, attempt)
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Writing


def _copy_with_sha256(src_url: str, dst_url: str, size: int) -> str:
    """Stream one file from staging to the release; returns the sha256 of the bytes written."""
    digest = hashlib.sha256()
    with storage.RangeReader(src_url, size) as reader:
        if reader.size != size:
            raise CorruptShard(f"staging file changed: listed {size} bytes, now {reader.size}", src_url)
        buffer = bytearray(min(COPY_CHUNK, size) or 1)
        with storage.open_write(dst_url) as out:
            offset = 0
            while offset < size:
                view = memoryview(buffer)[: min(len(buffer), size - offset)]
                reader.read_into(offset, view)
                digest.update(view)
                out.write(view)
                offset += len(view)
    return digest.hexdigest()


def _copy_all(staging_url: str, release_url: str, files: Sequence[FileEntry], max_workers: int,
              checksums: Mapping[str, str]) -> tuple[ManifestFile, ...]:
    """Copy every file; a file named in ``checksums`` whose copy hashed otherwise: `ChecksumMismatch`
    (the caller discards what was copied: nothing is published without the manifest)."""
    done: list[ManifestFile] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        futures = {
            pool.submit(_copy_with_sha256, storage.join(staging_url, f.path), storage.join(release_url, f.path),
                        f.size): f
            for f in files
        }
        for future in concurrent.futures.as_completed(futures):
            entry = futures[future]
            digest, expected = future.result(), checksums.get(entry.path)
            if expected is not None and digest != expected:
                raise ChecksumMismatch(f"{entry.path}: staged bytes hash to {digest[:16]}…, the merge wrote "
                                       f"{expected[:16]}…", storage.join(staging_url, entry.path))
            done.append(ManifestFile(entry.path, entry.size, digest))
    return tuple(sorted(done, key=lambda f: f.path))


def staged_sha256(staging_url: str, files: Sequence[FileEntry],
                  checksums: Mapping[str, str] | None) -> dict[str, str]:
    """The sha256 each staged file's copy must hash to: what the staging folder's ``stepmerge.json`` records (the
    writer's, every file but itself), which must agree with ``checksums`` (the shard jobs' own) and record every
    staged file with its size; with no ``stepmerge.json``, ``checksums`` alone. `ChecksumMismatch` naming the first
    disagreement, or a missing ``stepmerge.json`` when ``checksums`` are given (a merge always writes one)."""
    provenance = read_provenance(staging_url)
    if provenance is None:
        if checksums:
            raise ChecksumMismatch(f"staging holds no readable {PROVENANCE_FILE}: the merge wrote one recording "
                                   "every file's sha256", staging_url)
        return {}
    sizes, recorded = provenance.get("files"), provenance.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(recorded, dict):
        raise ChecksumMismatch(f"{PROVENANCE_FILE} records no sha256 of the staged files", staging_url)
    staged = {f.path: f.size for f in files if f.path != PROVENANCE_FILE}
    for path in sorted(set(staged) | set(sizes)):
        digest = recorded.get(path)
        if path not in staged or sizes.get(path) != staged[path] or not isinstance(digest, str):
            raise ChecksumMismatch(f"{path}: staged with {staged.get(path)} bytes, {PROVENANCE_FILE} records "
                                   f"{sizes.get(path)} bytes and sha256 {str(digest)[:16]}", staging_url)
    for path, digest in (checksums or {}).items():
        if recorded.get(path) != digest:
            raise ChecksumMismatch(f"{path}: the merge's sha256 {digest[:16]}… and {PROVENANCE_FILE}'s "
                                   f"{str(recorded.get(path))[:16]}… differ", storage.join(staging_url, path))
    return {path: recorded[path] for path in staged}


def _clear(release_url: str) -> None:
    """Delete everything under the release prefix except the claims (the marker first)."""
    storage.remove(storage.join(release_url, MARKER))
    for entry in storage.list_files(release_url):
        if entry.path.split("/")[0] != CLAIMS:
            storage.remove(storage.join(release_url, entry.path))


def _drop_staging(staging_url: str, remove_staging: bool) -> None:
    if remove_staging:
        storage.remove(staging_url, recursive=True)


def publish(staging_url: str, release_url: str, *, source: str, fingerprint: str, options: Mapping[str, Any],
            validation: ValidationReport | None, engine_version: str, overwrite: bool = False,
            remove_staging: bool = True, wait_s: float = 600.0, claim_ttl_s: float = CLAIM_TTL_S,
            max_workers: int = 4, checksums: Mapping[str, str] | None = None,
            clock: Clock = SYSTEM_CLOCK) -> Release:
    """Publish `staging_url` at `release_url` (see the module docstring for every rule).

    `validation` None publishes without a validation record (the manifest says ``null``).
    Raises `ValidationFailed` (validation not ok; staging removed, nothing published),
    `TargetExists` (released with another fingerprint and not ``overwrite``; staging kept), `InvalidOption`
    (empty staging, staged names that collide with ``manifest.json``/``_COMPLETE``/``_PUBLISHING``, or
    staging and release nested in each other),
    `ReleaseBusy` (another publisher held the release longer than ``wait_s``), `ClaimLost` (a
    `ReleaseBusy`: our claim vanished while we copied; no manifest or marker written, staging kept),
    `ChecksumMismatch` (a staged file differs from ``checksums`` or is gone; nothing published, staging
    removed). ``clock`` is where the waits, deadlines and heartbeats read the time (`merge_engine.output.clock`).
    """
    if overlaps(staging_url, release_url):
        raise InvalidOption(f"staging and release must not contain each other: {staging_url}, {release_url}")
    refuse_overlap(release_url, [source])  # clearing the release must never touch the checkpoint
    try:
        refuse_staged_links(staging_url)
    except UnsafeFile:
        _drop_staging(staging_url, remove_staging)  # never published: the next run merges again
        raise
    if validation is not None and not validation.ok:
        storage.remove(staging_url, recursive=True)
        first = validation.failures[0] if validation.failures else Check("checks", False, "no check ran")
        raise ValidationFailed(f"not published: {first.name}: {first.detail}", staging_url)
    files = storage.list_files(staging_url)
    if not files:
        raise InvalidOption("staging folder is empty", staging_url)
    clashing = [f.path for f in files if f.path.split("/")[0] in RESERVED]
    if clashing:
        raise InvalidOption(f"staged files use reserved names {clashing}", staging_url)
    missing = sorted(set(checksums or {}) - {f.path for f in files})
    if missing:
        _drop_staging(staging_url, remove_staging)
        raise ChecksumMismatch(f"the merge wrote {missing[:5]}, staging no longer holds them", staging_url)
    try:
        expected = staged_sha256(staging_url, files, checksums)
    except ChecksumMismatch:
        _drop_staging(staging_url, remove_staging)  # bytes the merge did not write: merge again
        raise
    options = portable_record(json.loads(json.dumps(dict(options), sort_keys=True, default=str)))
    files = [f for f in files if f.path != CARD]  # a staged README.md is another model's card: ours replaces it

    attempt = uuid.uuid4().hex
    deadline = clock.monotonic() + wait_s
    delay = 0.05
    while True:
        current = released_manifest(release_url)
        if current is not None:
            if current.fingerprint == fingerprint:
                if release_state(release_url).intact:  # checksums too: a damaged one is rebuilt
                    _drop_staging(staging_url, remove_staging)
                    return Release.from_manifest(release_url, current, already_published=True)
            elif not overwrite:
                raise TargetExists(f"released from another checkpoint (fingerprint {current.fingerprint[:12]}…); "
                                   "pass overwrite to replace it", release_url)
        if _try_claim(release_url, attempt, fingerprint, claim_ttl_s, clock):
            break
        if clock.monotonic() >= deadline:
            raise ReleaseBusy(f"another publisher holds {release_url} (waited {wait_s:.0f}s)")
        clock.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, 2.0)

    try:
        # Someone may have finished between our look and our claim: they released before we listed.
        current = released_manifest(release_url)
        if current is not None and current.fingerprint == fingerprint and release_state(release_url).intact:
            _drop_staging(staging_url, remove_staging)
            return Release.from_manifest(release_url, current, already_published=True)
        if current is not None and current.fingerprint != fingerprint and not overwrite:
            raise TargetExists("released from another checkpoint meanwhile", release_url)
        validation_record = None if validation is None else portable_validation(validation)
        with _Heartbeat(release_url, attempt, fingerprint, claim_ttl_s, clock) as heartbeat:

            def write_release(dest: str) -> Manifest:
                copied = _copy_all(staging_url, dest, files, max_workers, expected)
                facts = card_facts(dest, release_url, source=portable_url(source), fingerprint=fingerprint,
                                   options=options, validation=validation_record,
                                   files=[(f.path, f.size, f.sha256) for f in copied])
                copied = tuple(sorted(copied + (ManifestFile(*write_card(dest, facts)),), key=lambda f: f.path))
                listed = {e.path: e.version for e in storage.list_files(dest)}  # the store's own versions
                manifest = Manifest(
                    source=portable_url(source), fingerprint=fingerprint, engine_version=engine_version,
                    options=options,
                    validation=validation_record, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    attempt=attempt, files=tuple(dataclasses.replace(f, version=listed.get(f.path, "")) for f in copied),
                )
                manifest_bytes = json.dumps(manifest.to_dict(), indent=2, sort_keys=True).encode()
                heartbeat.check()  # still ours, never stale: nobody else may be writing
                storage.write_bytes(storage.join(dest, MANIFEST), manifest_bytes)
                marker = {"attempt": attempt, "fingerprint": fingerprint,
                          "manifest_sha256": sha256_hex(manifest_bytes), "created": manifest.created}
                storage.write_bytes(storage.join(dest, MARKER), json.dumps(marker, sort_keys=True).encode())
                return manifest

            if storage.is_local(release_url):  # built beside it, then swapped in whole (local_commit)
                target = storage.local_path(release_url).rstrip(os.sep)
                sweep_dead_siblings(target)
                with LiveFolder(target, kind="publish") as folder:
                    manifest = write_release(folder.path)
                    heartbeat.check()
                    commit_folder(folder.path, target)
            else:  # object stores: cleared, files, manifest, marker LAST; readers trust only the marker
                _clear(release_url)
                try:
                    manifest = write_release(release_url)
                except ChecksumMismatch:
                    _clear(release_url)  # no marker was written: what was copied is junk
                    raise
    except ChecksumMismatch:
        _drop_staging(staging_url, remove_staging)  # bytes the merge did not write: merge again
        raise
    finally:
        _remove_claim(release_url, attempt)
    _drop_staging(staging_url, remove_staging)
    return Release.from_manifest(release_url, manifest, already_published=False)


__all__ = ["publish", "claims_url", "Release", "ReleaseBusy", "ClaimLost", "CLAIM_TTL_S"]
