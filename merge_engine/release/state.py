"""Releases: where they live, what a release folder holds, what state one is in, what it records.

Layout (the one place it is spelled; `publish` writes it, the flows and tasks ask here)::

    <run_root>/releases/                               default release root (`default_release_root`;
                                                       discovery ignores it: no global_step_N folder)
      <role or "model">/global_step_<N>/               the merged model of a step (`release_url`)
      <role or "model">-adapter/global_step_<N>/       its LoRA adapter (LoRA runs)
        ...the staged files...
        manifest.json                                  every file with size and sha256 (`Manifest`)
        _COMPLETE                                      written last; holds the manifest's sha256
        _PUBLISHING/<attempt>.json                     claims of publishers at work (`merge_engine.release.publish`)

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
steps are out. `ReleaseProvenance` is the typed record a release's manifest keeps of where it came
from (``options`` in ``manifest.json``): kind, the step listing and checkpoint it was built from,
whether that checkpoint holds LoRA factors, and the options chosen.

What the pipeline asks a `ReleaseState` (read once per flow run and output, then asked; `state_of` reuses
a state read earlier for the same URL): `released_output` (a build already published here, or
`TargetExists` for another one), `output_available` (is a cached build's output still in staging or
here), `already_released` / `recorded_validation` (validate nothing: report what the manifest
recorded) and `is_current` (is a cached publication still the one here).

Staging: the merge writes to a local staging folder (``$STEPMERGE_STAGING_DIR``, else the system
temp dir), validation reads it there, publishing uploads it once. `staging_url` derives a name from
the release and the fingerprint, so a retry after a crash finds (and the engine reuses) a finished
merge. Publishing removes its staging folder (also when it refuses); a folder of ours that nobody
has written to for `STALE_STAGING_S` is removed by the next merge into the same staging root
(`sweep_stale_staging`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from merge_engine import storage
from merge_engine.release.built import BuiltOutput
from merge_engine.release.checksums import file_damage
from merge_engine.errors import InvalidConfig, StepmergeError, TargetExists
from merge_engine.formats.json_file import parse_json
from merge_engine.layouts.runs import VERL

if TYPE_CHECKING:  # validate imports torch: for the type only
    from merge_engine.validate.report import ValidationReport

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- layout

RELEASES_DIR = "releases"
MODEL, ADAPTER = "model", "adapter"
KINDS = (MODEL, ADAPTER)
MARKER = "_COMPLETE"
MANIFEST = "manifest.json"
CLAIMS = "_PUBLISHING"
RESERVED = (MARKER, MANIFEST, CLAIMS)  # names a staged output may not use
MANIFEST_FORMAT = "stepmerge.release/1"

_RELEASE_MARKER = re.compile(r"^(?P<name>[^/]+)/(?P<folder>[^/]+)/" + re.escape(MARKER) + "$")
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


# -------------------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class ManifestFile:
    """One published file. ``version``: what the store's listing said right after the copy (S3
    ETag, GCS generation; ``mtime-inode`` locally), so that a rewrite is seen from a listing
    (`merge_engine.release.checksums`, quick mode); empty in manifests written before it was recorded."""

    path: str
    size: int
    sha256: str
    version: str = ""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says about a release."""

    source: str
    fingerprint: str
    engine_version: str
    options: Mapping[str, Any]
    validation: Mapping[str, Any] | None
    created: str
    attempt: str
    files: tuple[ManifestFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def provenance(self) -> ReleaseProvenance:
        return ReleaseProvenance.from_manifest_options(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "source": {"url": self.source, "fingerprint": self.fingerprint},
            "engine_version": self.engine_version,
            "options": dict(self.options),
            "validation": None if self.validation is None else dict(self.validation),
            "created": self.created,
            "attempt": self.attempt,
            "total_bytes": self.total_bytes,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "version": f.version}
                      for f in self.files],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {data.get('format')!r}")
        return cls(
            source=data["source"]["url"],
            fingerprint=data["source"]["fingerprint"],
            engine_version=data["engine_version"],
            options=data.get("options") or {},
            validation=data.get("validation"),
            created=data["created"],
            attempt=data["attempt"],
            files=tuple(ManifestFile(f["path"], int(f["size"]), f["sha256"], str(f.get("version") or ""))
                        for f in data["files"]),
        )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(release: str) -> Manifest:
    """The release's manifest. Raises `InvalidConfig` when it is missing or unparsable."""
    url = storage.join(release, MANIFEST)
    try:
        return Manifest.from_dict(parse_json(storage.read_bytes(url), url, error=InvalidConfig))
    except FileNotFoundError as exc:
        raise InvalidConfig("no manifest.json", url) from exc
    except InvalidConfig:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidConfig(f"manifest.json unparsable: {exc}", url) from exc


def released_manifest(release: str) -> Manifest | None:
    """The manifest when the marker is present, parses and names this manifest's sha256; else None."""
    try:
        marker = parse_json(storage.read_bytes(storage.join(release, MARKER)), None)
        manifest_bytes = storage.read_bytes(storage.join(release, MANIFEST))
        if marker.get("manifest_sha256") != sha256_hex(manifest_bytes):
            return None
        return Manifest.from_dict(parse_json(manifest_bytes, None))
    except (FileNotFoundError, StepmergeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def is_released(release: str) -> bool:
    """True when readers may trust the folder: marker present and matching a parsable manifest."""
    return released_manifest(release) is not None


# ------------------------------------------------------------------------------------------ provenance

_PROVENANCE_KEYS = ("kind", "source_listing", "checkpoint_fingerprint", "checkpoint_lora")
_LORA_ALPHA, _HF_MODEL_PATH = "lora_alpha", "hf_model_path"


@dataclass(frozen=True)
class ReleaseProvenance:
    """Where a release came from, as its manifest records it (the ``options`` of ``manifest.json``).

    ``kind``: MODEL or ADAPTER. ``source_listing``: the fingerprint of the step folder's listing
    the release was built from (a watcher compares it with today's to tell a rewritten step).
    ``checkpoint_fingerprint``: the checked checkpoint's fingerprint. ``checkpoint_lora``: the
    checkpoint holds LoRA factors (so the step has an adapter release too). ``settings``: the
    options chosen (dtype, max_shard_size, hf_model_path, lora_alpha, ...), recorded as given.
    In the manifest all of these are one flat mapping (`to_manifest_options`); a field a manifest
    lacks (written before it was recorded) reads as None.
    """

    kind: Optional[str] = None
    source_listing: Optional[str] = None
    checkpoint_fingerprint: Optional[str] = None
    checkpoint_lora: Optional[bool] = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def lora_alpha(self) -> Optional[float]:
        return self.settings.get(_LORA_ALPHA)

    @property
    def hf_model_path(self) -> Optional[str]:
        return self.settings.get(_HF_MODEL_PATH)

    def is_trained_model_of(self, checkpoint_fingerprint: str, lora_alpha: Optional[float]) -> bool:
        """Is this the model release of exactly this checkpoint, fused with ``lora_alpha`` and the
        checkpoint's own config (so an adapter of the checkpoint must reproduce its logits)?"""
        return (self.checkpoint_fingerprint == checkpoint_fingerprint and self.lora_alpha == lora_alpha
                and self.hf_model_path is None)

    def to_manifest_options(self) -> dict[str, Any]:
        clashing = sorted(set(self.settings) & set(_PROVENANCE_KEYS))
        if clashing:
            raise ValueError(f"settings must not use the provenance keys {clashing}")
        return {**self.settings, "kind": self.kind, "source_listing": self.source_listing,
                "checkpoint_fingerprint": self.checkpoint_fingerprint, "checkpoint_lora": self.checkpoint_lora}

    @classmethod
    def from_manifest_options(cls, options: Any) -> ReleaseProvenance:
        options = options if isinstance(options, Mapping) else {}
        lora = options.get("checkpoint_lora")
        text = {key: options.get(key) if isinstance(options.get(key), str) else None
                for key in ("kind", "source_listing", "checkpoint_fingerprint")}
        return cls(**text, checkpoint_lora=lora if isinstance(lora, bool) else None,
                   settings={k: v for k, v in options.items() if k not in _PROVENANCE_KEYS})


# ------------------------------------------------------------------------------------------- state

ABSENT, IN_PROGRESS, PUBLISHED, DAMAGED = "absent", "in_progress", "published", "damaged"


@dataclass(frozen=True)
class ReleaseState:
    """What is at a release URL (see the module docstring for ``status``): ``manifest`` when a valid
    marker vouches for one; ``reason`` says what is wrong when not PUBLISHED."""

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


    # -- what the pipeline's stages ask (the state is read once per flow run and chain: `flows.stages`)

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

    def output_available(self, output: BuiltOutput) -> bool:
        """Is ``output`` (built for this release) still somewhere: its staging folder still holds files, or
        this release holds its fingerprint? (A cached build whose output is gone must be built again.)"""
        if not output.released and storage.list_files(output.url):
            return True
        return self.url == output.release_url and self.holds(output.fingerprint)

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
        if step is None:
            continue
        url = storage.join(release_root, match["name"], STEPS.folder(step))
        if is_released(url):
            found[(match["name"], step)] = url
    return found


# ----------------------------------------------------------------------------------------- staging

# staging folders (`staging_url`) and the engine's temp siblings of them (`merge_engine.output.target`)
_STAGING_NAME = re.compile(r"^\.?[0-9a-f]{16}-[0-9a-f]{16}(\.stepmerge-.*)?$")
STALE_STAGING_S = float(os.environ.get("STEPMERGE_STALE_STAGING_S", str(6 * 3600)))


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


__all__ = [
    "RELEASES_DIR", "MODEL", "ADAPTER", "KINDS", "MARKER", "MANIFEST", "CLAIMS", "RESERVED", "MANIFEST_FORMAT",
    "default_release_root", "release_folder_name", "release_url", "Manifest", "ManifestFile", "read_manifest",
    "released_manifest", "is_released", "ReleaseProvenance", "ABSENT", "IN_PROGRESS", "PUBLISHED", "DAMAGED",
    "ReleaseState", "release_state", "state_of", "withdraw_damaged", "published_releases", "default_staging_root",
    "staging_url", "sweep_stale_staging", "STALE_STAGING_S",
]
