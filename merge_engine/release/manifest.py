"""A release's manifest (``manifest.json``: every file with size, sha256 and the store's version; the options
it was built with) and its marker (``_COMPLETE``, written last, holding the manifest's sha256): `read_manifest`,
and `released_manifest` / `is_released`, which say whether a marker holds the manifest's sha256 (readers trust
only such folders)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.errors import InvalidConfig, StepmergeError
from merge_engine.release.folders import MANIFEST, MARKER
from merge_engine.release.provenance import ReleaseProvenance
from merge_engine.storage.json_text import parse_json

MANIFEST_FORMAT = "stepmerge.release/1"


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
