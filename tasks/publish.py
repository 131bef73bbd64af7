"""The publish task: staging + validation -> a release with manifest and ``_COMPLETE`` marker.

Wraps `merge_engine.release.publish.publish` (copy with sha256, manifest, marker last, claims so that two
publishers never both write). Not cached itself and persisting nothing: the last stage nested in its output's
chain (`flows.stages`), whose record is this task's `Release`; `release_current` tells whether such a record
still describes the release. The task adds:
- an output found already released (or a release that already holds this fingerprint) is returned
  as it is: nothing is copied twice. ``state``: the release's state as the flow read it at the chain's
  start (None: read here); a release published meanwhile by another run is found by the engine's publish,
  which looks again under its claim;
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
from prefect.cache_policies import NO_CACHE

import merge_engine
from merge_engine import storage
from merge_engine.errors import ChecksumMismatch, TargetExists, UnsafeFile, ValidationFailed
from merge_engine.release.built import BuiltOutput
from merge_engine.release.publish import Release, publish
from merge_engine.release.staging import drop_checksums
from merge_engine.release.state import ReleaseState, release_state, state_of, withdraw_damaged
from merge_engine.validate import ValidationReport
from tasks.retry import RETRY_OPTIONS


def release_current(release: Release, inputs: dict[str, Any]) -> bool:
    """Is a cached release still true (`ReleaseState.is_current`)? Asks the state the flow gave the task; a
    "no" from it is asked again of the release as it is now (a concurrent run may have published since)."""
    given = inputs.get("state")
    state = state_of(release.url, given)
    if state.is_current(release.fingerprint, release.attempt):
        return True
    return state is given and release_state(release.url).is_current(release.fingerprint, release.attempt)


@task(name="publish-release", cache_policy=NO_CACHE, persist_result=False, **RETRY_OPTIONS)
def publish_release(output: BuiltOutput, validation: ValidationReport, release: str,
                    options: Optional[dict[str, Any]] = None, overwrite: bool = False,
                    state: Optional[ReleaseState] = None) -> Release:
    """Publish ``output`` (validated by ``validation``) at ``release``; see the module docstring."""
    state = state_of(release, state)
    if state.holds(output.fingerprint) and state.manifest is not None:  # holds: it has one
        return Release.from_manifest(release, state.manifest, already_published=True)
    withdraw_damaged(state)  # readers must stop trusting a damaged release; it is published again
    if output.released:  # the record says released, the release says otherwise (deleted meanwhile)
        raise FileNotFoundError(f"{output.url} no longer holds release {output.fingerprint[:12]}; run the step "
                                "again to rebuild it")
    try:
        published = publish(output.url, release, source=output.source_url, fingerprint=output.fingerprint,
                            options=dict(options or {}), validation=validation,
                            engine_version=merge_engine.__version__, overwrite=overwrite,
                            checksums=dict(output.checksums))
    except TargetExists:
        storage.remove(output.url, recursive=True)  # refused: this staging folder will never be published
        drop_checksums(output.url)
        raise
    except (ValidationFailed, ChecksumMismatch, UnsafeFile):  # the engine removed the staging folder
        drop_checksums(output.url)
        raise
    drop_checksums(output.url)  # published: the staging folder is gone, its kept checksums with it
    return published
