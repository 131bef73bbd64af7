"""The publish task: staging + validation -> a release with manifest and ``_COMPLETE`` marker.

Wraps `merge_engine.release.publish.publish` (copy with sha256, manifest, marker last, claims so that two
publishers never both write). The task adds:
- cache key: the output's fingerprint and kind, the release URL and the validation verdict;
- an output found already released (or a release that already holds this fingerprint) is returned
  as it is: nothing is copied twice;
- a release whose marker is valid but whose files are damaged (a file deleted or resized; seen
  from one listing) loses its marker first, so the engine clears it and publishes it again;
- a failed validation publishes nothing (the engine removes the staging folder and raises
  `ValidationFailed`: a named error, not retried); a release built from something else, without
  ``overwrite``, is refused (`TargetExists`) and the staging folder removed too: nothing is left behind.
The shard jobs' sha256 of every weight file and index (``output.checksums``, from the merge) are
what the manifest records: the copy checks the bytes it reads from staging against them and a
mismatch is `ChecksumMismatch` (nothing published, the staging folder removed, so the next run
merges again).
The manifest's options record the merge options, the validation settings and the step listing's
fingerprint (``source_listing``), so a watcher can tell a release whose checkpoint was rewritten.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect import task

import merge_engine
from merge_engine import storage
from merge_engine.errors import TargetExists
from merge_engine.release.publish import Release, publish
from merge_engine.release.state import release_state, withdraw_damaged
from tasks.cache import stage_cache_policy
from tasks.records import OutputRecord, ReleaseRecord, ValidationRecord
from tasks.retry import RETRY_OPTIONS


def release_current(release: ReleaseRecord) -> bool:
    """Is a cached release record still true: the release whole, from its fingerprint, same attempt?"""
    state = release_state(release.url)
    return state.holds(release.fingerprint) and state.manifest is not None and state.manifest.attempt == release.attempt


@task(name="publish-release",
      cache_policy=stage_cache_policy("publish", ("output.fingerprint", "output.kind", "release", "validation.ok"),
                                      still_valid=release_current),
      persist_result=True, **RETRY_OPTIONS)
def publish_release(output: OutputRecord, validation: ValidationRecord, release: str,
                    options: Optional[dict[str, Any]] = None, overwrite: bool = False) -> ReleaseRecord:
    """Publish ``output`` (validated by ``validation``) at ``release``; see the module docstring."""
    state = release_state(release)
    if state.holds(output.fingerprint):
        return ReleaseRecord.from_release(Release.from_manifest(release, state.manifest, already_published=True))
    withdraw_damaged(state)  # readers must stop trusting a damaged release; it is published again
    if output.released:  # the record says released, the release says otherwise (deleted meanwhile)
        raise FileNotFoundError(f"{output.url} no longer holds release {output.fingerprint[:12]}; run the step "
                                "again to rebuild it")
    try:
        published = publish(output.url, release, source=output.source_url, fingerprint=output.fingerprint,
                            options=dict(options or {}), validation=validation.to_report(),
                            engine_version=merge_engine.__version__, overwrite=overwrite,
                            checksums=dict(output.checksums))
    except TargetExists:
        storage.remove(output.url, recursive=True)  # refused: this staging folder will never be published
        raise
    return ReleaseRecord.from_release(published)
