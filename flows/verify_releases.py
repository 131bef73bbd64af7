"""Flow ``verify-releases`` (on a schedule): is every published release still what was published?

One listing of ``release_root`` finds every release readers trust (a valid ``_COMPLETE`` marker,
`merge_engine.release.state.published_releases`); each is verified against its manifest by
`merge_engine.release.verify` (``mode="quick"``: object-store releases by the store versions recorded at
publish time, one listing each; local releases re-hashed. ``mode="full"``: every byte re-hashed).

A damaged release (a file missing, resized, rewritten, with other bytes, or unlisted) is named
with each bad file in the run's log and markdown artifact. With ``unmark_damaged`` (default) its
marker is removed, so readers stop trusting it and the watcher (``merge-new-steps``) rebuilds the
step on its next run; the files stay until then. The run FAILS when any release was damaged, so a
sweep that found damage never ends green. Verification errors of one release (storage down) are
reported and fail the run too, without stopping the others.

Like every flow, the sweep reads storage with the saved credential blocks (`flows.credentials`),
is named ``verify <release root's last folder>`` and tagged ``releases:<release root>`` and
``sweep`` (`flows.run_labels`), and leaves a markdown artifact (key ``verify-<root>``) whatever the
outcome: the table of releases, or the error that stopped the sweep before any was verified.
"""

import time
from typing import List, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from flows.credentials import storage_credentials
from flows.params import StorageUrl
from flows.run_labels import label_flow_run_with, short_run_name, verify_run_name
from merge_engine import storage
from merge_engine.release.folders import MARKER
from merge_engine.release.state import published_releases
from merge_engine.release.verify import MODES, verify_folder
from tasks.progress import artifact_key
from tasks.retry import RETRY_OPTIONS


class VerifiedRelease(BaseModel):
    """One release's verdict: ``status`` is "intact", "damaged" or "error"."""

    url: str
    status: str
    problems: List[str] = []
    bytes_hashed: int = 0
    method: str = ""
    unmarked: bool = False


class VerifySweep(BaseModel):
    release_root: str
    mode: str
    releases: List[VerifiedRelease]
    seconds: float

    @property
    def damaged(self) -> List[VerifiedRelease]:
        return [r for r in self.releases if r.status != "intact"]


class ReleasesDamaged(Exception):
    """The sweep found damaged releases (or could not verify some): the run fails, naming them."""


@task(name="verify-release", **RETRY_OPTIONS)
def verify_release_task(url: str, mode: str, unmark_damaged: bool) -> VerifiedRelease:
    report = verify_folder(url, mode=mode)
    if report.ok:
        return VerifiedRelease(url=url, status="intact", bytes_hashed=report.bytes_hashed, method=report.method)
    if unmark_damaged and report.marker_ok:
        storage.remove(storage.join(url, MARKER))  # readers stop trusting it; the watcher rebuilds it
    return VerifiedRelease(url=url, status="damaged", problems=list(report.problems) or ["no valid marker"],
                           bytes_hashed=report.bytes_hashed, method=report.method,
                           unmarked=unmark_damaged and report.marker_ok)


def _table(sweep: VerifySweep) -> str:
    rows = [f"| {r.url} | {r.status}{' (marker removed)' if r.unmarked else ''} | {r.method} | "
            f"{'; '.join(r.problems)[:500]} |" for r in sweep.releases]
    return "\n".join([f"# Releases under {sweep.release_root} ({sweep.mode})", "",
                      "| release | status | method | problems |", "|---|---|---|---|", *rows])


def sweep_key(release_root: str) -> str:
    """The summary artifact's key (lower-case letters, digits and dashes, as Prefect requires)."""
    import hashlib

    digest = hashlib.sha256(release_root.encode()).hexdigest()[:8]
    return artifact_key("verify", short_run_name(release_root), digest)


VerifyMode = Literal[MODES]  # type: ignore[valid-type]  # the form's dropdown; the server refuses another


@flow(name="verify-releases", flow_run_name=verify_run_name, log_prints=True)
def verify_releases(
    release_root: StorageUrl = Field(description="The release root to verify (where merge-step publishes): "
                                                 "s3://bucket/..., gs://bucket/... or a path"),
    mode: VerifyMode = Field("quick", description="quick: object-store releases by their recorded versions, "
                                                  "local ones re-hashed; full: every byte re-hashed"),
    unmark_damaged: bool = Field(True, description="Remove a damaged release's marker so that readers stop "
                                                   "trusting it and the watcher rebuilds it"),
) -> VerifySweep:
    """Verify every published release under ``release_root`` (see the module docstring)."""
    label_flow_run_with([f"releases:{release_root.rstrip('/')}", "sweep"])
    started = time.perf_counter()
    try:
        with storage_credentials():
            return _sweep(release_root, mode, unmark_damaged, started)
    except ReleasesDamaged:
        raise
    except Exception as exc:
        create_markdown_artifact(f"# Releases under {release_root} ({mode})\n\n**Failed** before any release "
                                 f"was verified: {type(exc).__name__}: {exc}\n", key=sweep_key(release_root),
                                 description="verify-releases failed")
        raise


def _sweep(release_root: str, mode: str, unmark_damaged: bool, started: float) -> VerifySweep:
    logger = get_run_logger()
    results: List[VerifiedRelease] = []
    for (_, _step), url in sorted(published_releases(release_root).items()):
        try:
            verdict = verify_release_task(url, mode, unmark_damaged)
        except Exception as exc:  # noqa: BLE001 - one release's error must not hide the others
            verdict = VerifiedRelease(url=url, status="error", problems=[f"{type(exc).__name__}: {exc}"])
        if verdict.status != "intact":
            logger.error("release %s %s: %s", url, verdict.status, "; ".join(verdict.problems))
        results.append(verdict)
    sweep = VerifySweep(release_root=release_root, mode=mode, releases=results,
                        seconds=time.perf_counter() - started)
    create_markdown_artifact(_table(sweep), key=sweep_key(release_root),
                             description=f"verify-releases: {len(results)} verified, {len(sweep.damaged)} damaged")
    logger.info("%d release(s) verified, %d damaged, in %.1f s", len(results), len(sweep.damaged), sweep.seconds)
    if sweep.damaged:
        raise ReleasesDamaged(f"{len(sweep.damaged)} damaged release(s) under {release_root}: "
                              + "; ".join(f"{r.url}: {', '.join(r.problems)}" for r in sweep.damaged))
    return sweep
